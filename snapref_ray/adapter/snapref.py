"""SnapRef (`anima_ref_kv/1`) as a `ReferenceAdapter`: its branches and mode weights laid out per MODEL block.

A 28-block adapter on the 40-block Anima-2.9B hooks the inherited blocks only
(docs/design.md#deeper-models-28-to-40-blocks); the 12 inserted blocks get no LoRA, but reference
K/V is still computed and read in all of them. Their read weight is that of the nearest inherited block
before them, so a mode's per-block profile keeps its shape over depth.

The reference stream runs once at sigma 0 with the reference LoRA branch (and the caption
through the cross-attention), K/V kept per block; every row of a render carries the target LoRA,
and the rows that read attend to the cached K/V with the mode's block weights x ref_weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from snapref_ray.adapter.file import SnapRefAdapter, load_adapter
from snapref_ray.adapter.reference_adapter import (
    Forward,
    PreparedReference,
    ReferenceAdapter,
    RowReader,
    require_finite,
)
from snapref_ray.adapter.refkv import ReadsCache, RefKV
from snapref_ray.models.block_map import adapter_block_map
from snapref_ray.models.dit import AnimaDiT
from snapref_ray.models.ops import BlockLoRA
from snapref_ray.requests import RenderSettings


@dataclass(frozen=True)
class BoundSnapRef(ReferenceAdapter):
    """A SnapRef adapter bound to a model of `model_blocks` blocks."""

    adapter: SnapRefAdapter
    model_blocks: int
    hooked: tuple[int | None, ...]  # model block -> adapter block, None for inserted blocks
    kind: ClassVar[str] = "snapref"

    @staticmethod
    def bind(
        adapter: SnapRefAdapter, model_blocks: int, device: torch.device | str, dtype: torch.dtype
    ) -> BoundSnapRef:
        mapping = adapter_block_map(adapter.meta.num_blocks, model_blocks)
        hooked: list[int | None] = [None] * model_blocks
        for adapter_block, model_block in enumerate(mapping):
            hooked[model_block] = adapter_block
        return BoundSnapRef(adapter.to(device=device, dtype=dtype), model_blocks, tuple(hooked))

    @classmethod
    def load(cls, path: str | Path, model_blocks: int, device: torch.device, dtype: torch.dtype) -> BoundSnapRef:
        return cls.bind(load_adapter(path), model_blocks, device, dtype)

    @property
    def identity(self) -> str:
        return self.adapter.identity

    def describe(self) -> dict:
        meta = self.adapter.meta
        return {
            "kind": self.kind,
            "identity": self.identity,
            "base_model": meta.base_model,
            "num_blocks": meta.num_blocks,
            "model_blocks": self.model_blocks,
            "modes": list(meta.modes),
        }  # not the file path: clients need not know the server's disk

    def reference_loras(self) -> list[BlockLoRA | None]:
        return [self.adapter.ref_loras[k] if k is not None else None for k in self.hooked]

    def target_loras(self) -> list[BlockLoRA | None]:
        return [self.adapter.target_loras[k] if k is not None else None for k in self.hooked]

    def read_weights(self, mode: str, ref_weight: float) -> list[float]:
        """ref_weight x the mode's block weight, per model block."""
        per_adapter_block = self.adapter.block_weights(mode).tolist()
        weights, last = [], per_adapter_block[0]
        for k in self.hooked:
            if k is not None:
                last = per_adapter_block[k]
            weights.append(ref_weight * float(last))
        return weights

    def rope_offset(self, target_grid: tuple[int, int, int]) -> tuple[int, int, int]:
        return self.adapter.resolve_rope_offset(target_grid)

    def reference_stream(
        self, dit: AnimaDiT, prepared: PreparedReference, target_grid: tuple[int, int, int], dtype: torch.dtype
    ) -> RefKV:
        loras = self.reference_loras()
        dt, dh, dw = self.rope_offset(target_grid)
        parts, grids, offsets = [], [], []
        for latent in prepared.latents:
            offset = (dt, dh, dw)
            kv_list = dit.reference_kv(latent, prepared.context, loras=loras, rope_offset=offset)
            kv = torch.stack([torch.stack([k, v]) for k, v in kv_list])  # [N, 2, H, L, D]
            require_finite(kv, prepared.reference_id)
            grid = dit.token_grid(latent.shape[-2], latent.shape[-1])
            parts.append(kv.to(dtype))
            grids.append(grid)
            offsets.append(offset)
            dw += grid[2]  # several references of one character sit side by side along w
        return RefKV(
            torch.cat(parts, dim=3), tuple(grids), tuple(offsets), target_grid, self.identity, prepared.reference_id
        )

    def reader(self, settings: RenderSettings) -> SnapRefReader:
        return SnapRefReader(self.target_loras(), self.read_weights(settings.mode, settings.ref_weight))


class SnapRefReader(RowReader):
    """Every row carries the target LoRA; the reading rows attend to the cached K/V with `weights` per block."""

    def __init__(self, target_loras: list[BlockLoRA | None], weights: list[float]) -> None:
        self.target_loras = target_loras
        self.weights = weights
        self._reads = ReadsCache()

    def forward(
        self,
        forward: Forward,
        x: torch.Tensor,
        sigma_B: torch.Tensor,
        context: torch.Tensor,
        reads: tuple[bool, ...],
        refkv: RefKV | None,
    ) -> torch.Tensor:
        refs = self._reads.reads(refkv, reads, self.weights)
        return forward(x, sigma_B, context, loras=self.target_loras, refs=refs)
