"""RefKV: a reference's per-block self-attention keys and values, computed once and re-read.

All blocks live in one contiguous tensor `kv_N2HLD` ([blocks, K/V, heads, ref_tokens, head_dim]):
moving it between devices is one copy, and turning it into bytes for Ray's object store is
one view. Pickling goes through a `uint8` numpy array so that Ray stores it out-of-band and a
reader on the same node maps it zero-copy and read-only (torch tensors would be copied on
every put and get; docs/design.md#ray-facts-this-design-relies-on).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import numpy as np
import torch

from snapref_ray.models.attention import RefRead

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16)}


@dataclass(frozen=True)
class RefKV:
    """Cached reference K/V for every model block, plus what it was computed from.

    kv_N2HLD: [blocks, 2 (K, V), heads, ref_tokens, head_dim]; K is after k-norm and RoPE at the
    reference positions `offsets` (resolved for `target_grid`), V as projected.
    grids: token grid (T, Hp, Wp) of each reference that was concatenated, in order.
    payload: "kv" (the above), or "frame_latent" for the ArcAnima pilot, whose reference is not a
    cache of K/V but its latent at the output size ([16, 1, h, w], model space): the pilot runs it
    through the DiT as a second frame at every step, so only the VAE encode is done once.
    """

    kv_N2HLD: torch.Tensor
    grids: tuple[tuple[int, int, int], ...]
    offsets: tuple[tuple[int, int, int], ...]
    target_grid: tuple[int, int, int]
    adapter_id: str
    reference_id: str
    encode_seconds: float = 0.0
    payload: str = "kv"

    @property
    def num_blocks(self) -> int:
        return self.kv_N2HLD.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.kv_N2HLD.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.kv_N2HLD.dtype

    @property
    def device(self) -> torch.device:
        return self.kv_N2HLD.device

    @property
    def nbytes(self) -> int:
        """Size of the cached K/V in bytes (what the object store and device caches hold)."""
        return self.kv_N2HLD.numel() * self.kv_N2HLD.element_size()

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> RefKV:
        kv = self.kv_N2HLD.to(device=device, dtype=dtype, non_blocking=True)
        return self if kv is self.kv_N2HLD else replace(self, kv_N2HLD=kv)

    def reads(self, rows: torch.Tensor, weights: list[float]) -> list[RefRead | None]:
        """One RefRead per model block for the given reading rows and per-block weights."""
        if len(weights) != self.num_blocks:
            raise ValueError(f"{len(weights)} block weights for a RefKV of {self.num_blocks} blocks")
        return [
            RefRead(self.kv_N2HLD[i, 0], self.kv_N2HLD[i, 1], rows, w) if w > 0 else None for i, w in enumerate(weights)
        ]

    @staticmethod
    def concat(parts: list[RefKV]) -> RefKV:
        """Several references of one character, read together: K/V joined along the token axis."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        for p in parts[1:]:
            if (p.num_blocks, p.adapter_id, p.target_grid, p.payload) != (
                first.num_blocks,
                first.adapter_id,
                first.target_grid,
                "kv",
            ):
                raise ValueError("RefKVs to concatenate must be K/V and share adapter, block count and target grid")
        kv = torch.cat([p.kv_N2HLD.to(first.device, first.dtype) for p in parts], dim=3)
        return RefKV(
            kv,
            sum((p.grids for p in parts), ()),
            sum((p.offsets for p in parts), ()),
            first.target_grid,
            first.adapter_id,
            "+".join(p.reference_id for p in parts),
            sum(p.encode_seconds for p in parts),
        )

    # -- serialisation: one uint8 buffer + a small header -------------------------------------
    def to_wire(self) -> tuple[dict, np.ndarray]:
        """(header, uint8 buffer) with no copy beyond moving to the CPU."""
        kv = self.kv_N2HLD.detach().to("cpu").contiguous()
        header = {
            "shape": tuple(kv.shape),
            "dtype": str(kv.dtype),
            "grids": self.grids,
            "offsets": self.offsets,
            "target_grid": self.target_grid,
            "adapter_id": self.adapter_id,
            "reference_id": self.reference_id,
            "encode_seconds": self.encode_seconds,
            "payload": self.payload,
        }
        return header, kv.reshape(-1).view(torch.uint8).numpy()

    @staticmethod
    def from_wire(header: dict, buffer: np.ndarray, device: torch.device | str | None = None) -> RefKV:
        """Rebuild from `to_wire` output. On CPU the tensor aliases `buffer` (read-only when it is)."""
        with warnings.catch_warnings():
            # Ray hands out read-only buffers; torch warns that it cannot enforce that. We never write.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = torch.from_numpy(buffer)
        kv = flat.view(_DTYPES[header["dtype"]]).reshape(header["shape"])
        if device is not None:
            kv = kv.to(device)
        return RefKV(
            kv,
            tuple(map(tuple, header["grids"])),
            tuple(map(tuple, header["offsets"])),
            tuple(header["target_grid"]),
            header["adapter_id"],
            header["reference_id"],
            header["encode_seconds"],
            header.get("payload", "kv"),
        )

    def __reduce__(self):
        header, buffer = self.to_wire()
        return (RefKV.from_wire, (header, buffer))


class ReadsCache:
    """The RefReads of the current RefKV per row layout, so that a render builds them once, not once per step.

    Keyed by the K/V tensor and the rows that read. A new RefKV (recompute_reference_every_step
    makes one per step) replaces the entries of the old one, so the cache holds one reference.
    """

    def __init__(self) -> None:
        self._reads: dict[tuple[int, tuple[bool, ...]], list[RefRead | None]] = {}

    def reads(self, refkv: RefKV | None, rows: tuple[bool, ...], weights: list[float]) -> list[RefRead | None] | None:
        """`refkv.reads(rows, weights)`, built once per (RefKV, rows); None when no row reads."""
        if refkv is None or not any(rows):
            return None
        key = (id(refkv.kv_N2HLD), rows)  # the cached RefReads keep the tensor alive: its id is not reused
        if key not in self._reads:
            if any(k[0] != key[0] for k in self._reads):
                self._reads.clear()
            self._reads[key] = refkv.reads(rows, weights)
        return self._reads[key]
