"""Step caching per image: ComfyUI's EasyCache rule, decided for each image of a batch.

EasyCache (ComfyUI's `EasyCache` node) estimates how much the model's output will change at a step from how
much its input changed, times the ratio between the two measured at the last full forward (the
"transformation rate" k). While the change accumulated since the last full forward stays below a threshold,
the step reuses the last output deltas (output - input, per row) instead of running the model:

    input_change_t  = mean|x_t - x_prev|            (over the image's latent)
    estimate_t      = k * input_change_t / mean|out_prev|
    accumulated    += estimate_t
    skip            when accumulated < threshold  (else run, and accumulated = 0)
    after a run:      k = mean|out_t - out_prev| / input_change_t,  out_prev = out_t,  x_prev = x_t,
                      delta_row = out_row - x_t  for every row of the image

only inside [start, end] of the schedule (fractions converted to σ as ComfyUI's `percent_to_sigma`); before
the window the state is kept up to date, after it every step runs. Every implementation we know takes the
decision once per call from statistics pooled over the batch, which lets one image's motion decide for its
neighbours; here each image has its own state and decides alone. An image's rows (both CFG branches and the
reference-guidance row) skip or run together, so its guidance stays consistent; the output statistics are
taken on its conditional row, as ComfyUI takes them on the first conditioning.

The decision is taken on the host between steps, from one read of a small [images, 3] tensor per step
(`decide`): this step's input change and the last full forward's output change and norm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from snapref_ray.requests import StepCache
from snapref_ray.sampling.schedules import percent_to_sigma


@dataclass
class _ImageState:
    rate: float | None = None  # k: output change / input change at the last full forward
    accumulated: float = 0.0
    out_norm: float | None = None
    input_change: float | None = None  # at the last full forward (k's denominator)
    skipped: int = 0


@dataclass
class StepCacheState:
    """The cache of one render (n images); `skipped` counts each image's skipped forwards."""

    rule: StepCache
    images: int
    start_sigma: float = field(init=False)
    end_sigma: float = field(init=False)
    reads: int = 0  # host reads taken (at most one per step)

    def __post_init__(self) -> None:
        self.start_sigma = percent_to_sigma(self.rule.start)
        self.end_sigma = percent_to_sigma(self.rule.end)
        self._state = [_ImageState() for _ in range(self.images)]
        self._x_prev: torch.Tensor | None = None  # [n, C, T, H, W]: each image's input at its last full forward
        self._out_prev: torch.Tensor | None = None  # [n, C, T, H, W]: its conditional row's output then
        self._pending: torch.Tensor | None = None  # [n, 2]: output change and norm of the last forward, on device
        self._fresh: list[bool] = [False] * self.images  # which images' _pending figures are new (they ran)
        self.deltas: dict[object, torch.Tensor] = {}  # row kind -> [n, C, T, H, W] output - input, last forward

    @property
    def skipped(self) -> list[int]:
        return [s.skipped for s in self._state]

    def decide(self, x_B: torch.Tensor, sigma: float, row_kinds: tuple) -> list[bool]:
        """Which images run the model at this step (True) and which reuse their deltas (False)."""
        n = self.images
        if sigma <= self.end_sigma:  # past the window: every image runs, nothing is tracked
            return [True] * n
        tracking = sigma <= self.start_sigma
        if self._x_prev is None or not tracking:
            return [True] * n
        input_change = (x_B - self._x_prev).abs().flatten(1).mean(1)  # [n]
        figures = torch.cat([input_change[:, None], self._pending], dim=1) if self._pending is not None else None
        values = (figures if figures is not None else input_change[:, None]).tolist()  # the step's one host read
        self.reads += 1
        runs = []
        for state, row, fresh in zip(self._state, values, self._fresh):
            change = row[0]
            if len(row) == 3 and fresh:  # the image's last forward: its transformation rate and output norm
                output_change, state.out_norm = row[1], row[2]
                if state.input_change:
                    state.rate = output_change / state.input_change
            can_reuse = all(kind in self.deltas for kind in row_kinds)
            if state.rate is None or not state.out_norm or not can_reuse:
                runs.append(True)
                state.input_change = change
                continue
            state.accumulated += state.rate * change / state.out_norm
            if state.accumulated < self.rule.threshold:
                state.skipped += 1
                runs.append(False)
            else:
                state.accumulated = 0.0
                state.input_change = change
                runs.append(True)
        self._pending, self._fresh = None, [False] * n
        return runs

    def record(self, x_B: torch.Tensor, sigma: float, runs: list[bool], outputs: dict[object, torch.Tensor]) -> None:
        """After the step's forward: `outputs[kind]` [n, ...] holds the model outputs of the running images' rows
        (rows of skipping images are ignored). Updates the running images' deltas and statistics, on device."""
        if sigma <= self.end_sigma:
            return
        run_idx = [i for i, r in enumerate(runs) if r]
        if not run_idx:
            return
        idx = torch.tensor(run_idx, device=x_B.device)
        cond = next(iter(outputs.values()))  # the conditional row kind comes first (sampling/ref_guidance.py)
        if self._x_prev is None:
            self._x_prev, self._out_prev = x_B.clone(), cond.clone()
            self._pending = None
        figures = torch.zeros(self.images, 2, device=x_B.device, dtype=torch.float32)
        out_run = cond[idx]
        figures[idx, 0] = (out_run - self._out_prev[idx]).abs().flatten(1).mean(1).float()
        figures[idx, 1] = out_run.abs().flatten(1).mean(1).float()
        self._pending, self._fresh = figures, list(runs)
        self._x_prev[idx] = x_B[idx]
        self._out_prev[idx] = out_run
        for kind, out in outputs.items():
            delta = self.deltas.get(kind)
            if delta is None:
                delta = self.deltas[kind] = torch.zeros_like(out)
            delta[idx] = out[idx] - x_B[idx]

    def reuse(self, x_B: torch.Tensor, kind: object, image: int) -> torch.Tensor:
        """A skipping image's output for row `kind`: its input plus the row's last delta."""
        return x_B[image] + self.deltas[kind][image]
