"""A LoRA branch that acts in some rows of a batch only, and costs work in those rows only.

ArcAnima's LoRA is "active only with the reference": in one batched CFG forward, the rows that
read the reference carry it and the others must not. `RowLoRA` computes the low-rank delta on
the carrying rows alone (gathered as slices of contiguous runs: a view in the usual layouts,
where the reading rows come first) and puts it back among zero rows, so its FLOPs scale with
the number of rows that carry it; the base weights stay untouched and the batch stays one
forward. Which rows carry it is host data, fixed per step plan: the forward never reads a device
tensor back, and a compiled forward (models/compiled.py) specialises on it as it does on
`RefRead.reading`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from snapref_ray.models.attention import row_runs, take_rows
from snapref_ray.models.ops import LoRAPair


@dataclass(frozen=True)
class RowLoRA:
    """`pair` in batch rows `rows` only (sorted, distinct host ints); the other rows get no delta.

    Duck-types `LoRAPair` for `ops.Linear`, which only calls `.delta(x)`; x is [B, L, in]
    (tokens, or the text context for the cross-attention k/v projections).
    """

    pair: LoRAPair
    rows: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.rows or list(self.rows) != sorted(set(self.rows)) or self.rows[0] < 0:
            raise ValueError(f"RowLoRA.rows must be distinct row indices >= 0 in increasing order, got {self.rows}")

    def delta(self, x_BLI: torch.Tensor) -> torch.Tensor:
        B = x_BLI.shape[0]
        if self.rows[-1] >= B:
            raise ValueError(f"RowLoRA.rows {self.rows} name rows of a batch of {B}")
        if len(self.rows) == B:
            return self.pair.delta(x_BLI)
        runs = row_runs(self.rows)
        delta_RLO = self.pair.delta(take_rows(x_BLI, runs))
        # Back among zero rows, in order, from slices (no index tensors, no scatter kernel).
        pieces, start, offset = [], 0, 0
        for a, b in runs:
            if a > start:
                pieces.append(delta_RLO.new_zeros(a - start, *delta_RLO.shape[1:]))
            pieces.append(delta_RLO[offset : offset + b - a])
            offset, start = offset + b - a, b
        if start < B:
            pieces.append(delta_RLO.new_zeros(B - start, *delta_RLO.shape[1:]))
        return torch.cat(pieces)
