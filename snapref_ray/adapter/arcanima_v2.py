"""ArcAnima v2 as a `ReferenceAdapter`: the cached asymmetric read.

The ArcAnima README, "How it works": the reference latent runs once per image through every block at
timestep 0, its tokens at RoPE positions shifted past the target grid, through self-attention
and MLP only (reference tokens skip the text cross-attention); each block's K/V is kept. In every
step the rows that read the reference attend over [target K/V; cached reference K/V] (the shared
`RefRead` seam) and carry the LoRA x strength; the other rows run the base model, as a second
sub-batch of the step when there are any. The LoRA is never merged.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from snapref_ray.adapter.arcanima import BoundArcAnima
from snapref_ray.adapter.file import AFTER_TARGET
from snapref_ray.adapter.reference_adapter import (
    Forward,
    PreparedReference,
    RowReader,
    forward_reading_and_plain_rows,
    require_finite,
)
from snapref_ray.adapter.refkv import ReadsCache, RefKV
from snapref_ray.models.dit import AnimaDiT
from snapref_ray.requests import RenderSettings


class ArcAnimaV2(BoundArcAnima):
    """ArcAnima v2 bound to a model."""

    kind: ClassVar[str] = "arcanima-v2"

    def rope_offset(self, target_grid: tuple[int, int, int]) -> tuple[int, int, int]:
        """The layout table's offset with `after_target` resolved against the target grid."""
        return tuple(
            int(size) if off == AFTER_TARGET else int(off)  # type: ignore[return-value]
            for off, size in zip(self.layout.rope_offset, target_grid)
        )

    @torch.inference_mode()
    def reference_kv(self, dit: AnimaDiT, latent: torch.Tensor, target_grid: tuple[int, int, int]) -> torch.Tensor:
        """The v2 reference stream of one latent ([1, 16, h, w], computed in its dtype): [blocks, 2, H, L, D].

        With `lora_in_reference_stream` (off by default) the LoRA acts at multiplier 1 here: the cache
        is per reference, shared by every strength.
        """
        loras = self.full_loras(1.0) if self.layout.lora_in_reference_stream else None
        kv_list = dit.reference_kv(
            latent, None, loras=loras, rope_offset=self.rope_offset(target_grid), cross_attention=False
        )
        return torch.stack([torch.stack([k, v]) for k, v in kv_list])

    def reference_stream(
        self, dit: AnimaDiT, prepared: PreparedReference, target_grid: tuple[int, int, int], dtype: torch.dtype
    ) -> RefKV:
        latent = prepared.latents[0]  # one reference, or a stitched pair: never several (kinds.KINDS)
        kv = self.reference_kv(dit, latent, target_grid)  # fp32 stream, as SnapRef's
        require_finite(kv, prepared.reference_id)
        grid = dit.token_grid(latent.shape[-2], latent.shape[-1])
        return RefKV(
            kv.to(dtype), (grid,), (self.rope_offset(target_grid),), target_grid, self.identity, prepared.reference_id
        )

    def reader(self, settings: RenderSettings) -> V2Reader:
        return V2Reader(self, self.lora_multiplier(settings))


class V2Reader(RowReader):
    """Reading rows attend to [target; cached reference] and carry the LoRA x strength; the others run the base.

    When only some rows read (ref_in_uncond off, or the ref-guidance row), the two groups run as
    two sub-batches of the step: the LoRA and the read then cost work in the reading rows only.
    Measured against one forward with the LoRA delta gathered to the reading rows, sub-batches
    took 3.5-18 % less CPU time at the width-scaled shapes (benchmarks/v2_lora_rows.py).
    """

    def __init__(self, bound: ArcAnimaV2, strength: float) -> None:
        self.loras = bound.full_loras(strength) if strength != 0 else None
        self._reads = ReadsCache()
        self._weights = [1.0] * bound.model_blocks  # v2 reads every block at full weight

    def forward(
        self,
        forward: Forward,
        x: torch.Tensor,
        sigma_B: torch.Tensor,
        context: torch.Tensor,
        reads: tuple[bool, ...],
        refkv: RefKV | None,
    ) -> torch.Tensor:
        if refkv is None or not any(reads):
            return forward(x, sigma_B, context)

        def reading(x_R: torch.Tensor, sigma_R: torch.Tensor, context_R: torch.Tensor) -> torch.Tensor:
            refs = self._reads.reads(refkv, (True,) * x_R.shape[0], self._weights)
            return forward(x_R, sigma_R, context_R, loras=self.loras, refs=refs)

        return forward_reading_and_plain_rows(reads, x, sigma_B, context, reading, forward)
