"""Matmul FLOPs of one sampling step for each row of the timing table, at any size (832x1216 by default).

The same counting as `benchmarks/common.py: dit_forward_flop_breakdown` (every linear and LoRA
branch, QK^T and AV, adaLN bottlenecks, patch embed, time embedding, final layer), extended to
the ways each adapter kind spends a step. A test pins the two models to each other. This is a
floor, not a prediction: it ignores memory traffic, softmax and norms, which weigh more on small
GPUs and on CPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from snapref_ray.models.dit import BLOCK_LINEARS, PATCH, DiTConfig, real_dit_config

CONTEXT_ROWS = 512  # Anima pads every prompt's context to 512 rows


def _linear_dims(config: DiTConfig) -> dict[str, tuple[int, int]]:
    D, C, M = config.model_channels, config.context_dim, config.mlp_hidden
    inner = config.num_heads * config.head_dim
    dims = {p: (D, inner) for p in BLOCK_LINEARS}
    dims.update(
        {
            "self_attn.output_proj": (inner, D),
            "cross_attn.output_proj": (inner, D),
            "cross_attn.k_proj": (C, inner),
            "cross_attn.v_proj": (C, inner),
            "mlp.layer1": (D, M),
            "mlp.layer2": (M, D),
        }
    )
    return dims


@dataclass(frozen=True)
class RowGroup:
    """Batch rows that cost the same in one forward."""

    rows: int
    tokens: int  # query tokens per row (target, or target + reference frame for the pilot)
    extra_keys: int = 0  # cached reference keys each query also attends to (SnapRef, v2)
    lora_ranks: tuple[tuple[str, int], ...] = ()  # runtime LoRA on these linears
    cross_attention: bool = True
    final_layer: bool = True


def forward_flops(config: DiTConfig, group: RowGroup, context_rows: int = CONTEXT_ROWS) -> float:
    D, inner, r_ad = config.model_channels, config.num_heads * config.head_dim, config.adaln_lora_dim
    L, S, R = group.tokens, context_rows, group.rows
    ranks = dict(group.lora_ranks)
    per_block = 0.0
    for path, (fan_in, fan_out) in _linear_dims(config).items():
        if path.startswith("cross_attn") and not group.cross_attention:
            continue
        n = S if path in ("cross_attn.k_proj", "cross_attn.v_proj") else L
        per_block += 2.0 * n * fan_in * fan_out
        if ranks.get(path):
            per_block += 2.0 * n * ranks[path] * (fan_in + fan_out)
    per_block += 3 * (2.0 * D * r_ad + 2.0 * r_ad * 3 * D)  # adaLN, once per row
    per_block += 4.0 * L * (L + group.extra_keys) * inner  # self-attention QK^T + AV
    if group.cross_attention:
        per_block += 4.0 * L * S * inner
    total = per_block * config.num_blocks
    total += 2.0 * L * (config.in_channels + 1) * PATCH * PATCH * D + 2.0 * D * D + 2.0 * D * 3 * D
    if group.final_layer:
        total += 2.0 * D * r_ad + 2.0 * r_ad * 2 * D + 2.0 * L * D * PATCH * PATCH * config.in_channels
    return total * R


@dataclass(frozen=True)
class Case:
    width: int = 832
    height: int = 1216
    reference_tokens: int = 4096  # a 1 MP reference (SnapRef, v2)
    snapref_ranks: tuple[int, int] = (128, 64)  # reference, target branch
    v2_rank: int = 64
    pilot_rank: int = 32

    @property
    def tokens(self) -> int:
        return (self.height // 16) * (self.width // 16)


def step_flops(name: str, config: DiTConfig, case: Case, *, cfg: bool = True, ref_guidance_rows: float = 0.0) -> float:
    """FLOPs of one step of timing row `name`; `ref_guidance_rows`: the share of steps with the extra row."""
    L, Lr = case.tokens, case.reference_tokens
    plain = RowGroup(1, L)
    rows_text = 2 if cfg else 1
    snap_target = (("self_attn.q_proj", case.snapref_ranks[1]),)
    ten = lambda r: tuple((p, r) for p in BLOCK_LINEARS)  # noqa: E731
    if name == "no_reference":
        return forward_flops(config, RowGroup(rows_text, L))
    # The step-cache row's steps that run cost what SnapRef's default does; the ones it skips cost
    # nothing here (the table's "forwards skipped" column counts them).
    snapref_rows = ("snapref_default", "ref_in_uncond", "ref_guidance_apg", "ref_end_0.6", "recompute_every_step")
    if name in (*snapref_rows, "turbo", "step_cache"):
        reading = 1 if name in ("snapref_default", "recompute_every_step", "turbo", "step_cache") else 2
        rows = 1 if name == "turbo" else rows_text
        total = forward_flops(config, RowGroup(reading, L, Lr, snap_target))
        total += forward_flops(config, RowGroup(rows - reading, L, 0, snap_target)) if rows > reading else 0.0
        total += ref_guidance_rows * forward_flops(config, RowGroup(1, L, 0, snap_target))
        if name == "recompute_every_step":
            total += forward_flops(config, RowGroup(1, Lr, 0, ten(case.snapref_ranks[0]), final_layer=False))
        return total
    if name.startswith("arcanima_v2"):
        reading = rows_text  # both CFG rows read the cached reference
        total = forward_flops(config, RowGroup(reading, L, Lr, ten(case.v2_rank)))
        return total + ref_guidance_rows * forward_flops(config, plain)
    if name.startswith("arcanima_pilot"):
        reading = rows_text  # both CFG rows carry the reference frame (at the output size: L more tokens)
        total = forward_flops(config, RowGroup(reading, 2 * L, 0, ten(case.pilot_rank)))
        return total + ref_guidance_rows * forward_flops(config, plain)
    raise ValueError(f"no FLOP model for timing row {name!r}")


def real_size_ratios(rows: dict[str, float], *, steps: int, case: Case = Case(), cfg: bool = True) -> dict[str, float]:
    """{row name: FLOP ratio of a step against the no-reference step} at real size.

    rows: name -> share of steps that run the extra ref-guidance row (0 when none).
    """
    config = real_dit_config()
    base = step_flops("no_reference", config, case, cfg=cfg)
    return {
        name: step_flops(name, config, case, cfg=cfg, ref_guidance_rows=share) / base for name, share in rows.items()
    }
