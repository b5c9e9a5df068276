"""Flow-matching sampling for Anima: σ schedules, initial noise, samplers and guidance."""

from snapref_ray.sampling.guidance import APG, apg_project, cfg, rescale_cfg
from snapref_ray.sampling.noise import initial_noise, noise_scaling
from snapref_ray.sampling.samplers import Denoiser, sample, sample_er_sde, sample_euler
from snapref_ray.sampling.schedules import flow_sigma_table, get_sigmas, percent_to_sigma

__all__ = [
    "APG",
    "Denoiser",
    "apg_project",
    "cfg",
    "flow_sigma_table",
    "get_sigmas",
    "initial_noise",
    "noise_scaling",
    "percent_to_sigma",
    "rescale_cfg",
    "sample",
    "sample_er_sde",
    "sample_euler",
]
