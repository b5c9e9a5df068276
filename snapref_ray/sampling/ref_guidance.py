"""Which batch rows run at a step, which of them read the reference, and how they combine.

Rows (per request; the batch stacks each kind for all requests):
- COND: positive prompt; reads the reference when there is one.
- UNCOND: negative prompt; reads it only with `ref_in_uncond` or on the ref-guidance path.
- COND_NOREF: positive prompt without the reference; only when ref_guidance != 1, inside
  [ref_start, ref_end].

D = D_u + cfg * (D_c - D_u) + (ref_guidance - 1) * (D_c - D_c,noref)

The rows, the corrections and each kind's defaults: docs/design.md#which-rows-read-and-reference-guidance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from snapref_ray.requests import RenderSettings
from snapref_ray.sampling.guidance import APG, apg_project, rescale_cfg
from snapref_ray.sampling.guidance import cfg as cfg_combine
from snapref_ray.sampling.schedules import percent_to_sigma

# Reference-guidance corrections. APG keeps the delta's component orthogonal to D_c,ref and
# drops the parallel one (eta 0, the APG paper's choice against over-saturation), after
# ComfyUI's per-channel norm threshold of 5. RescaleCFG uses phi 0.5 as the SnapRef node does.
REF_APG_ETA = 0.0
REF_APG_NORM_THRESHOLD = 5.0
REF_RESCALE_PHI = 0.5
TEXT_RESCALE_PHI = 0.7  # ComfyUI RescaleCFG default


class Row(str, Enum):
    COND = "cond"
    UNCOND = "uncond"
    COND_NOREF = "cond_noref"


@dataclass(frozen=True)
class StepRows:
    rows: tuple[Row, ...]
    reads: tuple[bool, ...]  # per row kind: does it read the reference
    ref_guidance_active: bool


def in_ref_window(settings: RenderSettings, sigma: float) -> bool:
    """ref_start/ref_end are schedule fractions, compared in sigma as ComfyUI's timestep ranges are."""
    return percent_to_sigma(settings.ref_end) <= sigma <= percent_to_sigma(settings.ref_start)


def _concrete(settings: RenderSettings) -> RenderSettings:
    """Settings with the kind-dependent fields filled in (SnapRef's defaults when still unset)."""
    if settings.ref_guidance is None or settings.ref_in_uncond is None or settings.ref_outside is None:
        from snapref_ray.adapter.controls import resolve_settings

        return resolve_settings(settings, None)
    return settings


def step_rows(settings: RenderSettings, sigma: float, has_reference: bool) -> StepRows:
    """The rows this step needs (the uncond pass is skipped at cfg 1, as ComfyUI does).

    ref_outside="no_reference" (ArcAnima's guider option): outside [ref_start, ref_end] no row
    reads the reference, so those steps are plain text-to-image steps.
    """
    settings = _concrete(settings)
    need_uncond = settings.cfg != 1.0
    inside = in_ref_window(settings, sigma)
    if not has_reference or (settings.ref_outside == "no_reference" and not inside):
        rows = (Row.COND, Row.UNCOND) if need_uncond else (Row.COND,)
        return StepRows(rows, (False,) * len(rows), False)
    guided = settings.ref_guidance != 1.0 and settings.ref_weight > 0
    active = guided and inside
    rows = [Row.COND] + ([Row.UNCOND] if need_uncond else []) + ([Row.COND_NOREF] if active else [])
    uncond_reads = settings.ref_in_uncond or guided
    reads = tuple({Row.COND: True, Row.UNCOND: uncond_reads, Row.COND_NOREF: False}[r] for r in rows)
    return StepRows(tuple(rows), reads, active)


@dataclass
class Combiner:
    """Turns the per-row denoised estimates of one step into D; holds the APG state of a run."""

    settings: RenderSettings
    _apg: APG = field(default_factory=APG)

    def __post_init__(self) -> None:
        self.settings = _concrete(self.settings)

    def __call__(
        self, x: torch.Tensor, sigma: torch.Tensor, plan: StepRows, denoised: dict[Row, torch.Tensor]
    ) -> torch.Tensor:
        s = self.settings
        d_cond = denoised[Row.COND]
        if Row.UNCOND in denoised:
            d_uncond = denoised[Row.UNCOND]
            if s.cfg_correction == "apg":
                out = self._apg(d_cond, d_uncond, sigma, s.cfg)
            elif s.cfg_correction == "rescale":
                out = rescale_cfg(x, sigma, d_cond, d_uncond, s.cfg, TEXT_RESCALE_PHI)
            else:
                out = cfg_combine(d_cond, d_uncond, s.cfg)
        else:
            out = d_cond
        if plan.ref_guidance_active:
            delta = d_cond - denoised[Row.COND_NOREF]
            if s.correction == "apg":
                delta = apg_project(delta, d_cond, REF_APG_ETA, REF_APG_NORM_THRESHOLD)
            out = out + (s.ref_guidance - 1.0) * delta
            if s.correction == "rescale":
                out = rescale_towards(x, sigma, out, d_cond, REF_RESCALE_PHI)
        return out


def rescale_towards(
    x: torch.Tensor, sigma: torch.Tensor, guided: torch.Tensor, cond: torch.Tensor, phi: float
) -> torch.Tensor:
    """RescaleCFG's std matching applied to a combined estimate (docs/design.md#guidance-cfg-rescalecfg-apg)."""
    s = sigma.reshape(-1, *[1] * (x.ndim - 1)) if sigma.ndim else sigma
    root = torch.sqrt(s * s + 1.0)
    x_in = x / (s * s + 1.0)
    g = (x_in - guided) * root / s
    c = (x_in - cond) * root / s
    dims = tuple(range(1, min(4, x.ndim)))
    g_rescaled = g * (c.std(dim=dims, keepdim=True) / g.std(dim=dims, keepdim=True))
    g_final = phi * g_rescaled + (1.0 - phi) * g
    return x_in - g_final * s / root
