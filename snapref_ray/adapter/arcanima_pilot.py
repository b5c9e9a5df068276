"""The ArcAnima pilot as a `ReferenceAdapter`: the reference as a second latent frame.

The reference latent at the output size is appended to the noisy target as a second latent
frame (RoPE frame index 1) and the two-frame sequence runs through the DiT with the LoRA at
every step; the target frame's output is kept. Rows that do not read run one frame without the
LoRA (a separate, shorter forward). Nothing is cached but the VAE encode of the frame.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from snapref_ray.adapter.arcanima import BoundArcAnima
from snapref_ray.adapter.reference_adapter import Forward, PreparedReference, RowReader, forward_reading_and_plain_rows
from snapref_ray.adapter.refkv import RefKV
from snapref_ray.models.dit import AnimaDiT
from snapref_ray.models.ops import BlockLoRA
from snapref_ray.requests import RenderError, RenderSettings


class ArcAnimaPilot(BoundArcAnima):
    """The ArcAnima pilot bound to a model."""

    kind: ClassVar[str] = "arcanima-pilot"

    def reference_stream(
        self, dit: AnimaDiT, prepared: PreparedReference, target_grid: tuple[int, int, int], dtype: torch.dtype
    ) -> RefKV:
        latent = prepared.latents[0]
        grid = dit.token_grid(latent.shape[-2], latent.shape[-1])
        if grid != target_grid:
            raise RenderError(f"the pilot's reference frame is {grid} tokens, the target {target_grid}")
        # Nothing to cache but the VAE encode: the frame runs through the DiT at every step.
        return RefKV(
            latent[0].unsqueeze(1).to(dtype),  # [16, 1, h, w]
            (grid,),
            ((1, 0, 0),),  # the second frame of the two-frame forward
            target_grid,
            self.identity,
            prepared.reference_id,
            payload="frame_latent",
        )

    def reader(self, settings: RenderSettings) -> PilotReader:
        strength = self.lora_multiplier(settings)
        return PilotReader(self.full_loras(strength) if strength != 0 else None)


class PilotReader(RowReader):
    """Reading rows run as [target; reference] frames with the LoRA; the others as one frame without it."""

    def __init__(self, loras: list[BlockLoRA | None] | None) -> None:
        self.loras = loras

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
            frame = refkv.kv_N2HLD.to(x_R.dtype).unsqueeze(0).expand(x_R.shape[0], -1, -1, -1, -1)
            two = torch.cat([x_R, frame], dim=2)  # [R, 16, 2, h, w]: frame 0 target, frame 1 reference
            return forward(two, sigma_R, context_R, loras=self.loras)[:, :, :1]

        return forward_reading_and_plain_rows(reads, x, sigma_B, context, reading, forward)
