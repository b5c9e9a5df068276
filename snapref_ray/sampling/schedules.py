"""Flow-matching sigma schedules for Anima, as ComfyUI computes them.

Anima is a rectified-flow model (x_σ = (1−σ)·x0 + σ·noise) whose ComfyUI `model_sampling`
(`ModelSamplingDiscreteFlow`, shift 3) holds a 1000-entry σ table; schedulers pick entries of
that table. Everything is float32 like ComfyUI's buffers, so a schedule equals ComfyUI's bit
for bit.
"""

from __future__ import annotations

import torch

TABLE_SIZE = 1000  # ComfyUI's `timesteps` for discrete-flow models
DEFAULT_SHIFT = 3.0  # Anima's sampling_settings["shift"]


def _shift_time(t, shift: float):
    """Time-SNR shift: σ(t) = shift·t / (1 + (shift−1)·t); works on floats and tensors."""
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


def flow_sigma_table(shift: float = DEFAULT_SHIFT) -> torch.Tensor:
    """The model's σ table S[i] = shift((i+1)/1000), i = 0..999, float32 [1000]; S[999] = 1."""
    t = torch.arange(1, TABLE_SIZE + 1) / TABLE_SIZE  # int64 / int -> float32, as ComfyUI
    return _shift_time(t, shift).to(torch.float32)


def percent_to_sigma(p: float, shift: float = DEFAULT_SHIFT) -> float:
    """σ at fraction `p` of the schedule: 1.0 at p ≤ 0, 0.0 at p ≥ 1, shift(1−p) between."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    return float(_shift_time(1.0 - p, shift))


def _simple(steps: int, shift: float) -> torch.Tensor:
    table = flow_sigma_table(shift)
    # ComfyUI evaluates floor(k·1000/N) as int(k·(1000/N)) in double precision; for a few N
    # (e.g. N=38, k=19) that lands one table entry lower than the exact floor. Keep its arithmetic.
    stride = len(table) / steps
    sigmas = [float(table[-(1 + int(k * stride))]) for k in range(steps)]
    return torch.tensor(sigmas + [0.0], dtype=torch.float32)


SCHEDULERS = {"simple": _simple}


def get_sigmas(scheduler: str, steps: int, shift: float = DEFAULT_SHIFT, denoise: float = 1.0) -> torch.Tensor:
    """The σ schedule for `steps` steps, float32 [steps + 1], ending in 0.

    With denoise < 1 (img2img) the schedule is computed for int(steps/denoise) steps and its last
    steps + 1 entries are kept, as ComfyUI's KSampler does (denoise > 0.9999 counts as 1).
    """
    if scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; known schedulers: {', '.join(sorted(SCHEDULERS))}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if not 0.0 < denoise <= 1.0:
        raise ValueError(f"denoise must be in (0, 1], got {denoise}")
    make = SCHEDULERS[scheduler]
    if denoise > 0.9999:
        return make(steps, shift)
    return make(int(steps / denoise), shift)[-(steps + 1) :].clone()
