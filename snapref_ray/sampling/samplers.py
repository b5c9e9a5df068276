"""The samplers: plain functions of (denoise, x, sigmas, seed), k-diffusion style.

`denoise(x, σ)` returns the model's denoised estimate D (guidance already applied: it is built by
composition in the caller). Both samplers reproduce ComfyUI's `sample_euler` (s_churn 0) and
`sample_er_sde` (s_noise 1, max_stage 3, default noise scaler) for a flow (CONST) model, see
docs/design.md#samplers.

The schedule stays on the host. `sigmas` is moved to the CPU once, so every σ the loop branches
on, passes to `denoise` or multiplies into x is a host number (a CPU 0-dim tensor in device
arithmetic is read on the host, not copied back): a step never waits for the device to read σ.

Seeds of er_sde. ComfyUI seeds one generator with the KSampler seed (seed + 1 when x is on the CPU)
and draws one randn of the whole batch per stochastic step: that is what one int seed does here.
A list of seeds gives every batch row its own generator (seeded the same way from that row's seed)
drawing its own row, so a row does not depend on its batch neighbours (what batch jobs need). For
one row both are the same stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from snapref_ray.sampling.schedules import DEFAULT_SHIFT, percent_to_sigma

Denoiser = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Callback = Callable[[int, int], None]

ER_SDE_POINTS = 200  # integration points of the stage-2/3 integrals
ER_SDE_FIRST_SIGMA_PERCENT = 1e-4  # σ0 = 1 has an infinite λ; ComfyUI starts from percent_to_sigma(1e-4)


class StepNoise:
    """er_sde's standard-normal draws: one generator for the whole batch (an int seed, as ComfyUI),
    or one generator per row (a list of seeds, row b seeded with seeds[b])."""

    def __init__(self, x: torch.Tensor, seed: int | Sequence[int]) -> None:
        # ComfyUI's default_noise_sampler adds 1 on the CPU so the step noise is not the initial noise.
        offset = 1 if x.device.type == "cpu" else 0
        seeds = [seed] if isinstance(seed, int) else [int(s) for s in seed]
        if not isinstance(seed, int) and len(seeds) != x.shape[0]:
            raise ValueError(f"got {len(seeds)} seeds for a batch of {x.shape[0]} rows")
        self.seeds = [s + offset for s in seeds]
        self.generators: list[torch.Generator] = []  # made at the first draw (none when s_noise is 0)
        self.whole_batch = isinstance(seed, int)
        self.shape = tuple(x.shape) if self.whole_batch else tuple(x.shape[1:])
        self.device, self.dtype = x.device, x.dtype

    def draw(self) -> torch.Tensor:
        if not self.generators:
            self.generators = [torch.Generator(device=self.device).manual_seed(s) for s in self.seeds]
        draws = [torch.randn(self.shape, generator=g, device=self.device, dtype=self.dtype) for g in self.generators]
        return draws[0] if self.whole_batch else torch.stack(draws)


def sample_euler(
    denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, callback: Callback | None = None
) -> torch.Tensor:
    """Euler steps on the probability-flow ODE: x ← x + (x − D)/σ_i · (σ_{i+1} − σ_i)."""
    sigmas = host_schedule(sigmas)
    steps = len(sigmas) - 1
    for i in range(steps):
        denoised = denoise(x, sigmas[i])
        d = (x - denoised) / sigmas[i]
        x = x + d * (sigmas[i + 1] - sigmas[i])
        if callback is not None:
            callback(i, steps)
    return x


def host_schedule(sigmas: torch.Tensor) -> torch.Tensor:
    """The σ schedule as a CPU float32 tensor (one copy per render when it was on a device)."""
    return sigmas.to(device="cpu", dtype=torch.float32)


def _er_sde_noise_scaler(lam: torch.Tensor) -> torch.Tensor:
    return lam * ((lam**0.3).exp() + 10.0)


def sample_er_sde(
    denoise: Denoiser,
    x: torch.Tensor,
    sigmas: torch.Tensor,
    seed: int | Sequence[int] = 0,
    callback: Callback | None = None,
    *,
    s_noise: float = 1.0,
    max_stage: int = 3,
    shift: float = DEFAULT_SHIFT,
) -> torch.Tensor:
    """Extended reverse-time SDE solver (ER-SDE-Solver-3), ComfyUI's `sample_er_sde` for a flow model.

    `shift` only sets the replacement first σ (percent_to_sigma(1e-4)) when the schedule starts at σ = 1.
    """
    sigmas = host_schedule(sigmas)
    if len(sigmas) > 1 and sigmas[0].item() >= 1:
        # The first model call runs at this σ, while x was initialised for σ = 1.
        sigmas = sigmas.clone()
        sigmas[0] = percent_to_sigma(ER_SDE_FIRST_SIGMA_PERCENT, shift)
    lambdas = torch.logit(sigmas).exp()  # λ = σ/(1−σ) = σ/α; λ_N = 0 at σ = 0
    noise = StepNoise(x, seed)
    point_index = torch.arange(0, ER_SDE_POINTS, dtype=torch.float32)  # the integrals are host scalars too

    steps = len(sigmas) - 1
    old_denoised = old_denoised_d = None
    for i in range(steps):
        denoised = denoise(x, sigmas[i])
        stage = min(max_stage, i + 1)
        if sigmas[i + 1].item() == 0:
            x = denoised
        else:
            lam_s, lam_t = lambdas[i], lambdas[i + 1]
            alpha_s, alpha_t = sigmas[i] / lam_s, sigmas[i + 1] / lam_t
            r = _er_sde_noise_scaler(lam_t) / _er_sde_noise_scaler(lam_s)
            x = (alpha_t / alpha_s) * r * x + alpha_t * (1 - r) * denoised  # stage 1
            if stage >= 2:
                dt = lam_t - lam_s
                h = -dt / ER_SDE_POINTS
                points = lam_t + point_index * h
                scaled_points = _er_sde_noise_scaler(points)
                s1 = torch.sum(1 / scaled_points) * h
                denoised_d = (denoised - old_denoised) / (lam_s - lambdas[i - 1])
                x = x + alpha_t * (dt + s1 * _er_sde_noise_scaler(lam_t)) * denoised_d
                if stage >= 3:
                    s2 = torch.sum((points - lam_s) / scaled_points) * h
                    denoised_u = (denoised_d - old_denoised_d) / ((lam_s - lambdas[i - 2]) / 2)
                    x = x + alpha_t * (dt**2 / 2 + s2 * _er_sde_noise_scaler(lam_t)) * denoised_u
                old_denoised_d = denoised_d
            if s_noise > 0:
                spread = (lam_t**2 - lam_s**2 * r**2).sqrt().nan_to_num(nan=0.0)
                x = x + alpha_t * noise.draw() * s_noise * spread
        old_denoised = denoised
        if callback is not None:
            callback(i, steps)
    return x


SAMPLERS = ("euler", "er_sde")


def sample(
    denoise: Denoiser,
    x: torch.Tensor,
    sigmas: torch.Tensor,
    sampler: str = "euler",
    seed: int | Sequence[int] = 0,
    callback: Callback | None = None,
    *,
    shift: float = DEFAULT_SHIFT,
) -> torch.Tensor:
    """Run `sampler` from x (already noised for sigmas[0]) down the schedule; returns the final x.

    `seed` drives the stochastic samplers only (euler ignores it): one int draws the whole batch from one
    generator as ComfyUI does; a list gives each row its own generator (batch-invariant rows).
    `callback(step_index, total_steps)` is called after each step.
    """
    if sampler == "euler":
        return sample_euler(denoise, x, sigmas, callback)
    if sampler == "er_sde":
        return sample_er_sde(denoise, x, sigmas, seed, callback, shift=shift)
    raise ValueError(f"unknown sampler {sampler!r}; known samplers: {', '.join(SAMPLERS)}")
