"""Classifier-free guidance and the two corrections Anima users run: RescaleCFG and APG.

All functions take denoised estimates (D = x − σ·v) as ComfyUI's guidance hooks see them and
return the guided D. The formulas: docs/design.md#guidance-cfg-rescalecfg-apg.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The latent's last three dims, [C, T, H, W] -> (T, H, W): APG's norms and projections are per channel.
_APG_DIMS = (-1, -2, -3)


def _per_row(sigma: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor | float:
    """σ as a scalar or a [B, 1, ...] tensor that broadcasts against `like`."""
    if isinstance(sigma, torch.Tensor) and sigma.ndim > 0:
        return sigma.reshape(-1, *[1] * (like.ndim - 1)).to(like.dtype)
    return sigma


def cfg(d_cond: torch.Tensor, d_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain CFG: D = D_u + s·(D_c − D_u)."""
    return d_uncond + (d_cond - d_uncond) * scale


def rescale_cfg(
    x: torch.Tensor,
    sigma: torch.Tensor | float,
    d_cond: torch.Tensor,
    d_uncond: torch.Tensor,
    scale: float,
    multiplier: float = 0.7,
) -> torch.Tensor:
    """ComfyUI's RescaleCFG node: CFG in (EDM-style) v space with the result's std pulled to the cond's.

    The v conversion is the one ComfyUI applies as-is to this flow model. The std is unbiased over
    dims (1, 2, 3), which for the 5-D [B, C, T, H, W] latent is (C, T, H), i.e. per (row, column W);
    kept as ComfyUI has it. multiplier 0 is plain CFG.
    """
    sigma = _per_row(sigma, x)
    x_in = x / (sigma * sigma + 1.0)
    to_v = (sigma * sigma + 1.0) ** 0.5 / sigma
    v_cond = (x_in - d_cond) * to_v
    v_uncond = (x_in - d_uncond) * to_v
    v_cfg = v_uncond + scale * (v_cond - v_uncond)
    std_cond = torch.std(v_cond, dim=(1, 2, 3), keepdim=True)
    std_cfg = torch.std(v_cfg, dim=(1, 2, 3), keepdim=True)
    v_final = multiplier * (v_cfg * (std_cond / std_cfg)) + (1.0 - multiplier) * v_cfg
    return x_in - v_final / to_v


def apg_project(delta: torch.Tensor, reference: torch.Tensor, eta: float, norm_threshold: float) -> torch.Tensor:
    """APG's correction of a guidance delta: g_⊥ + eta·g_∥ after clipping g's per-channel norm.

    `norm_threshold` > 0 scales each channel of `delta` (norm over (T, H, W)) down to at most that
    norm; the split into parallel and orthogonal parts is with respect to `reference` per channel.
    """
    if norm_threshold > 0:
        norm = delta.norm(p=2, dim=_APG_DIMS, keepdim=True)
        delta = delta * torch.minimum(torch.ones_like(norm), norm_threshold / norm)
    unit = F.normalize(reference, dim=_APG_DIMS)
    parallel = (delta * unit).sum(dim=_APG_DIMS, keepdim=True) * unit
    orthogonal = delta - parallel
    return orthogonal + eta * parallel


class APG:
    """ComfyUI's APG node (adaptive projected guidance), as a stateful guidance step.

    `__call__` returns the final D = D_c + s·g′ (g′ the corrected delta). That is what ComfyUI's node
    produces after the CFG formula — which means its effective scale is s, not the paper's s − 1:
    with eta = 1 and no threshold or momentum it equals CFG with scale s + 1. The momentum running
    average resets when σ rises (a new sampling run). Like ComfyUI's hook it only applies when there
    is an uncond pass: at CFG 1 the caller uses D_c as it is.
    """

    def __init__(self, eta: float = 1.0, norm_threshold: float = 5.0, momentum: float = 0.0) -> None:
        self.eta = eta
        self.norm_threshold = norm_threshold
        self.momentum = momentum
        self.reset()

    def reset(self) -> None:
        """Forget the running average and the last σ."""
        self.running_avg: torch.Tensor | None = None
        self.prev_sigma: float | None = None

    def __call__(
        self, d_cond: torch.Tensor, d_uncond: torch.Tensor, sigma: torch.Tensor | float, scale: float
    ) -> torch.Tensor:
        sigma = float(sigma.flatten()[0]) if isinstance(sigma, torch.Tensor) else float(sigma)
        if self.prev_sigma is not None and sigma > self.prev_sigma:
            self.running_avg = None
        self.prev_sigma = sigma

        delta = d_cond - d_uncond
        if self.momentum != 0:
            if self.running_avg is None:
                self.running_avg = delta
            else:
                self.running_avg = self.momentum * self.running_avg + delta
            delta = self.running_avg
        return d_cond + scale * apg_project(delta, d_cond, self.eta, self.norm_threshold)
