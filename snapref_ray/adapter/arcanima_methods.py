"""How the DiT runs with an ArcAnima adapter: v2's cached asymmetric read and the pilot's two frames.

v2 (seed 002, "How it works"): the reference latent runs once per image through every block at
timestep 0, its tokens at RoPE positions shifted past the target grid, through self-attention
and MLP only (reference tokens skip the text cross-attention); each block's K/V is kept. In every
step the rows that read the reference attend over [target K/V; cached reference K/V] (the shared
`RefRead` seam) and carry the LoRA x strength; the other rows run the base model. One batched
forward per step, the LoRA never merged.

pilot: the reference latent at the output size is appended to the noisy target as a second
latent frame (RoPE frame index 1) and the two-frame sequence runs through the DiT with the LoRA
at every step; the target frame's output is kept. Rows that do not read run one frame without
the LoRA (a separate, shorter forward).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from snapref_ray.adapter.arcanima import BoundArcAnima
from snapref_ray.adapter.file import AFTER_TARGET
from snapref_ray.models.attention import RefRead
from snapref_ray.models.dit import AnimaDiT


def v2_rope_offset(bound: BoundArcAnima, target_grid: tuple[int, int, int]) -> tuple[int, int, int]:
    """The layout table's offset with `after_target` resolved against the target grid."""
    return tuple(
        int(size) if off == AFTER_TARGET else int(off)  # type: ignore[return-value]
        for off, size in zip(bound.layout.rope_offset, target_grid)
    )


@torch.inference_mode()
def v2_reference_kv(
    dit: AnimaDiT, bound: BoundArcAnima, latent: torch.Tensor, target_grid: tuple[int, int, int]
) -> torch.Tensor:
    """The v2 reference stream of one latent ([1, 16, h, w], computed in its dtype): [blocks, 2, H, L, D].

    With `lora_in_reference_stream` (off by default) the LoRA acts at multiplier 1 here: the cache
    is per reference, shared by every strength.
    """
    loras = bound.full_loras(1.0) if bound.layout.lora_in_reference_stream else None
    kv_list = dit.reference_kv(
        latent, None, loras=loras, rope_offset=v2_rope_offset(bound, target_grid), cross_attention=False
    )
    return torch.stack([torch.stack([k, v]) for k, v in kv_list])


def v2_forward(
    dit: AnimaDiT,
    bound: BoundArcAnima,
    x: torch.Tensor,
    sigma_B: torch.Tensor,
    context: torch.Tensor,
    reads: Sequence[bool],
    kv_N2HLD: torch.Tensor | None,
    strength: float,
) -> torch.Tensor:
    """Velocity of a batch whose rows `reads` read the cached reference (LoRA x strength there only)."""
    if kv_N2HLD is None or not any(reads):
        return dit(x, sigma_B, context)
    rows = torch.tensor(list(reads), device=x.device)
    loras = bound.row_loras(rows.to(torch.float32) * strength) if strength != 0 else None
    refs = [RefRead(kv_N2HLD[i, 0], kv_N2HLD[i, 1], tuple(reads), 1.0) for i in range(kv_N2HLD.shape[0])]
    return dit(x, sigma_B, context, loras=loras, refs=refs)


def pilot_forward(
    dit: AnimaDiT,
    bound: BoundArcAnima,
    x: torch.Tensor,
    sigma_B: torch.Tensor,
    context: torch.Tensor,
    reads: Sequence[bool],
    frame_C1HW: torch.Tensor | None,
    strength: float,
) -> torch.Tensor:
    """Velocity of a batch [B, 16, 1, h, w]: reading rows as [target; reference] frames with the LoRA."""
    if frame_C1HW is None or not any(reads):
        return dit(x, sigma_B, context)
    idx_read = [i for i, r in enumerate(reads) if r]
    idx_plain = [i for i, r in enumerate(reads) if not r]
    v = torch.empty_like(x)
    frame = frame_C1HW.to(x.dtype).unsqueeze(0).expand(len(idx_read), -1, -1, -1, -1)
    two = torch.cat([x[idx_read], frame], dim=2)  # [k, 16, 2, h, w]: frame 0 target, frame 1 reference
    loras = bound.full_loras(strength) if strength != 0 else None
    v[idx_read] = dit(two, sigma_B[idx_read], context[idx_read], loras=loras)[:, :, :1]
    if idx_plain:
        v[idx_plain] = dit(x[idx_plain], sigma_B[idx_plain], context[idx_plain])
    return v
