"""An adapter bound to a model: its branches and mode weights laid out per MODEL block.

A 28-block adapter on the 40-block Anima-2.9B hooks the inherited blocks only
(snapref-adapter.md §7); the 12 inserted blocks get no LoRA, but reference K/V is still
computed and read in all of them. Their read weight is that of the nearest inherited block
before them, so a mode's per-block profile keeps its shape over depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from snapref_ray.adapter.file import SnapRefAdapter
from snapref_ray.models.block_map import adapter_block_map
from snapref_ray.models.ops import BlockLoRA


@dataclass(frozen=True)
class BoundAdapter:
    adapter: SnapRefAdapter
    model_blocks: int
    hooked: tuple[int | None, ...]  # model block -> adapter block, None for inserted blocks

    @staticmethod
    def bind(
        adapter: SnapRefAdapter, model_blocks: int, device: torch.device | str, dtype: torch.dtype
    ) -> BoundAdapter:
        mapping = adapter_block_map(adapter.meta.num_blocks, model_blocks)
        hooked: list[int | None] = [None] * model_blocks
        for adapter_block, model_block in enumerate(mapping):
            hooked[model_block] = adapter_block
        return BoundAdapter(adapter.to(device=device, dtype=dtype), model_blocks, tuple(hooked))

    @property
    def identity(self) -> str:
        return self.adapter.identity

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
