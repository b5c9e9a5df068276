"""Synthetic SnapRef adapters at any size: random ones for tests and benchmarks, zero ones as no-ops.

No trained SnapRef weights are needed to exercise the whole path: a random adapter changes a
tiny model's output measurably (so tests can see every branch is wired), a zero adapter must
leave it exactly unchanged (so tests can see nothing else changed), and an adapter on the
`meta` device gives the real parameter count and file sizes without allocating 760 MB.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Literal

import torch

from snapref_ray.adapter.file import (
    AFTER_TARGET,
    REF_LINEARS,
    TARGET_LINEARS,
    AdapterError,
    AdapterMeta,
    SnapRefAdapter,
    linear_dims,
)
from snapref_ray.models.ops import BlockLoRA, LoRAPair

_DTYPE_FORMATS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
KNOWN_MODES = ("cs", "char")


def char_mode_weights(num_blocks: int) -> torch.Tensor:
    """A plausible `char` vector, float32 [num_blocks]; a stand-in, not a trained one.

    `char` keeps the character and lets the prompt set the style. Style lives mostly in the
    late, texture-level blocks of a DiT, so this vector reads the reference fully in the first
    two thirds of the blocks and fades it on a half-cosine to 0.25 at the last block.
    """
    weights = []
    for i in range(num_blocks):
        t = i / (num_blocks - 1) if num_blocks > 1 else 0.0
        fade = min(max((t - 2 / 3) * 3, 0.0), 1.0)  # 0 up to 2/3 of the depth, 1 at the last block
        weights.append(0.25 + 0.75 * 0.5 * (1 + math.cos(math.pi * fade)))
    return torch.tensor(weights, dtype=torch.float32)


def make_adapter(
    *,
    num_blocks: int = 28,
    model_channels: int = 2048,
    context_dim: int = 1024,
    mlp_hidden: int = 8192,
    ref_rank: int = 128,
    target_rank: int = 64,
    ref_alpha: float | None = None,
    target_alpha: float | None = None,
    init: Literal["random", "zero"] = "random",
    seed: int = 0,
    modes: tuple[str, ...] = ("cs", "char"),
    base_model: str = "anima-base-v1.0",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    scale: float = 0.1,
    ref_rope_offset: tuple[int | str, int | str, int | str] = (0, AFTER_TARGET, AFTER_TARGET),
) -> SnapRefAdapter:
    """A SnapRef adapter with synthetic weights; the defaults are the real size (190,840,832 parameters).

    init="random": down ~ N(0, 1/in) and up ~ N(0, 1/rank) · scale / (alpha/rank), so each LoRA
    delta has about `scale` times the RMS of its input — a visible change that stays finite.
    init="zero": the standard LoRA init (down random, up = 0), an exact no-op.
    Weights are drawn on the CPU from `seed` in a fixed order, so they do not depend on `device`;
    device="meta" allocates nothing. Modes: `cs` is all ones, `char` is `char_mode_weights`.
    """
    if init not in ("random", "zero"):
        raise ValueError(f"init must be 'random' or 'zero', found {init!r}")
    unknown = [m for m in modes if m not in KNOWN_MODES]
    if unknown:
        raise ValueError(f"make_adapter knows modes {', '.join(KNOWN_MODES)}, found {unknown}")
    if dtype not in _DTYPE_FORMATS:
        raise ValueError(f"dtype must be one of {', '.join(map(str, _DTYPE_FORMATS))}, found {dtype}")
    meta = AdapterMeta(
        base_model=base_model,
        num_blocks=num_blocks,
        model_channels=model_channels,
        ref_rank=ref_rank,
        target_rank=target_rank,
        ref_alpha=float(ref_alpha if ref_alpha is not None else ref_rank),
        target_alpha=float(target_alpha if target_alpha is not None else target_rank),
        ref_rope_offset=ref_rope_offset,
        weight_format=_DTYPE_FORMATS[dtype],
        modes=tuple(modes),
    )
    for name, value in (("context_dim", context_dim), ("mlp_hidden", mlp_hidden)):
        if value <= 0:
            raise AdapterError(f"{name} must be a positive integer, found {value}")

    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)

    def pair(linear: str, rank: int, lora_scale: float) -> LoRAPair:
        fan_in, fan_out = linear_dims(linear, model_channels, context_dim, mlp_hidden)
        if device.type == "meta":
            return LoRAPair(
                torch.empty(rank, fan_in, device=device, dtype=dtype),
                torch.empty(fan_out, rank, device=device, dtype=dtype),
                lora_scale,
            )
        down = torch.randn(rank, fan_in, generator=generator) / math.sqrt(fan_in)
        if init == "zero":
            up = torch.zeros(fan_out, rank)
        else:
            up = torch.randn(fan_out, rank, generator=generator) * (scale / math.sqrt(rank) / lora_scale)
        return LoRAPair(down.to(device=device, dtype=dtype), up.to(device=device, dtype=dtype), lora_scale)

    def branch(linears: tuple[str, ...], rank: int, lora_scale: float) -> list[BlockLoRA]:
        return [{linear: pair(linear, rank, lora_scale) for linear in linears} for _ in range(num_blocks)]

    ref_loras = branch(REF_LINEARS, ref_rank, meta.ref_scale)
    target_loras = branch(TARGET_LINEARS, target_rank, meta.target_scale)
    vectors = {"cs": torch.ones(num_blocks), "char": char_mode_weights(num_blocks)}
    # The meta device cannot hold values; mode vectors are tiny, so keep them real on the CPU then.
    mode_device = torch.device("cpu") if device.type == "meta" else device
    mode_weights = {m: vectors[m].to(mode_device) for m in modes}

    recipe = dict(
        num_blocks=num_blocks,
        model_channels=model_channels,
        context_dim=context_dim,
        mlp_hidden=mlp_hidden,
        ref_rank=ref_rank,
        target_rank=target_rank,
        ref_alpha=meta.ref_alpha,
        target_alpha=meta.target_alpha,
        init=init,
        seed=seed,
        modes=list(modes),
        base_model=base_model,
        scale=scale,
        ref_rope_offset=list(meta.ref_rope_offset),
    )
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()
    return SnapRefAdapter(
        meta=meta,
        ref_loras=ref_loras,
        target_loras=target_loras,
        mode_weights=mode_weights,
        identity=f"generated:{digest}",
        source=f"make_adapter(init={init!r}, seed={seed})",
    )
