"""Matmul FLOPs of one sampling step for each row of the timing table, at any size (832x1216 by default).

Each row's step is a sum of DiT forwards counted by the project's one FLOP model
(`snapref_ray/models/flops.py`, which the benchmarks' GFLOP/s figures also use): this module only
says how each adapter kind spends a step (which rows, which read the reference, which LoRA). This
is a floor, not a prediction: it ignores memory traffic, softmax and norms, which weigh more on
small GPUs and on CPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from snapref_ray.geometry import token_count
from snapref_ray.models.conditioning import CONTEXT_ROWS  # every prompt's context is padded to 512 rows
from snapref_ray.models.dit_config import BLOCK_LINEARS, DiTConfig, real_dit_config
from snapref_ray.models.flops import dit_forward_flops


@dataclass(frozen=True)
class RowGroup:
    """Batch rows that cost the same in one forward."""

    rows: int
    tokens: int  # query tokens per row (target, or target + reference frame for the pilot)
    extra_keys: int = 0  # cached reference keys each query also attends to (SnapRef, v2)
    lora_ranks: tuple[tuple[str, int], ...] = ()  # runtime LoRA on these linears
    final_layer: bool = True


def forward_flops(config: DiTConfig, group: RowGroup, context_rows: int = CONTEXT_ROWS) -> float:
    """FLOPs of one forward over `group`'s rows, every one of which reads its `extra_keys`."""
    return dit_forward_flops(
        config,
        rows=group.rows,
        tokens=group.tokens,
        context_rows=context_rows,
        reading_rows=group.rows if group.extra_keys else 0,
        ref_tokens=group.extra_keys,
        lora_ranks=dict(group.lora_ranks),
        final_layer=group.final_layer,
    )


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
        return token_count(height=self.height, width=self.width)


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
