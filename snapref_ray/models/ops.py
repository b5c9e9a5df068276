"""Layers that compute in the dtype of their input, whatever dtype their weights are stored in.

ComfyUI's "manual cast" ops do the same: weights stay in the file's dtype (bf16, fp16, or
float8 with a scale) and are cast to the activation dtype at each call. That is what lets the
SnapRef reference stream run in fp32 on a bf16 or fp8 model without a second copy of the
weights, and it is why every DiT linear takes an optional runtime LoRA: the reference and
target LoRA branches of an adapter are applied unmerged, per call, never by patching weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class LoRAPair:
    """One low-rank branch: delta(h) = up(down(h)) * scale, with down [r, in] and up [out, r]."""

    down: torch.Tensor
    up: torch.Tensor
    scale: float

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        down = self.down.to(x.dtype)
        up = self.up.to(x.dtype)
        return F.linear(F.linear(x, down), up) * self.scale

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> LoRAPair:
        return LoRAPair(self.down.to(device=device, dtype=dtype), self.up.to(device=device, dtype=dtype), self.scale)


# Module path inside a block ("self_attn.q_proj") -> the branch applied to that linear.
BlockLoRA = dict[str, LoRAPair]


class Linear(nn.Module):
    """A bias-optional linear layer whose weight may be stored as float8 with a scale.

    `weight_scale` is None for ordinary weights; for float8 weights it is either a scalar
    (per-tensor) or a [out] vector (per-row) and the dequantised weight is `weight * scale`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False) if bias else None
        )
        self.weight_scale: torch.Tensor | None = None

    def compute_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as `dtype`, dequantised when it is stored as float8."""
        w = self.weight
        if w.dtype in FLOAT8_DTYPES:
            w = w.to(torch.float32)
            if self.weight_scale is not None:
                scale = self.weight_scale.to(device=w.device, dtype=torch.float32)
                w = w * (scale.reshape(-1, 1) if scale.ndim == 1 else scale)
        return w.to(dtype)

    def forward(self, x: torch.Tensor, lora: LoRAPair | None = None) -> torch.Tensor:
        y = self.base_output(x)
        if lora is not None:
            y = y + lora.delta(x)
        return y

    def base_output(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b without the LoRA branch: the one matmul `models.fp8.Float8Linear` replaces."""
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.compute_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class RMSNorm(nn.Module):
    """RMSNorm with a learnable weight, computed in fp32 and cast back (as ComfyUI and HF do)."""

    def __init__(
        self, dim: int, eps: float = 1e-6, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)
