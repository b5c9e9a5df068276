"""Rotary position embeddings: the DiT's 3D (t, h, w) RoPE and the LLM adapter's 1D RoPE.

Both use the rotate-half pairing: head dim j is rotated together with dim j + head_dim/2 by the
angle of pair j. For the DiT the 64 pair angles of a token are
`concat[t * w_t (d_t/2), h * w_h (d_h/2), w * w_w (d_w/2)]` with d_h = d_w = head_dim // 6 * 2
and d_t = the rest (44, 42, 42 for head_dim 128), and NTK-scaled bases
`theta = 10000 * ratio ** (d / (d - 2))` with ratios (t, h, w) = (1, 4, 4), as Cosmos-Predict2
(and so Anima) was trained.

Positions are integer patch indices plus an optional offset per axis. The offset is how the
SnapRef reference stream sits "next to" the target: RoPE is relative, so shifting every
reference position by (dt, dh, dw) only rotates its keys by a fixed per-pair angle.
"""

from __future__ import annotations

import torch

ROPE_THETA = 10000.0
# (t, h, w) NTK extrapolation ratios of Cosmos-Predict2 2B as used by Anima.
DIT_ROPE_RATIOS = (1.0, 4.0, 4.0)


def dit_rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """(d_t, d_h, d_w): how many head dims encode each axis (44, 42, 42 for head_dim 128)."""
    d_h = head_dim // 6 * 2
    return head_dim - 2 * d_h, d_h, d_h


def _axis_frequencies(dim: int, ratio: float, device: torch.device | str | None) -> torch.Tensor:
    """The dim/2 angular frequencies of one axis, NTK-scaled: theta ** (-2k / dim), fp32."""
    theta = ROPE_THETA * ratio ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device)[: dim // 2] / dim
    return 1.0 / (theta**exponents)


def dit_rope(
    grid: tuple[int, int, int],
    head_dim: int,
    *,
    offset: tuple[int, int, int] = (0, 0, 0),
    device: torch.device | str | None = None,
    ratios: tuple[float, float, float] = DIT_ROPE_RATIOS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the DiT's 3D RoPE for a (T, Hp, Wp) token grid, each [T*Hp*Wp, head_dim/2] fp32.

    Token order is the row-major flatten of (t, h, w), the DiT's sequence order. Token (t, h, w)
    sits at position (t + offset[0], h + offset[1], w + offset[2]).
    """
    dims = dit_rope_axis_dims(head_dim)
    angles = []
    for axis, (size, dim, ratio, off) in enumerate(zip(grid, dims, ratios, offset)):
        pos = torch.arange(size, dtype=torch.float32, device=device) + float(off)
        axis_angles = torch.outer(pos, _axis_frequencies(dim, ratio, device))  # [size, dim/2]
        shape = [1, 1, 1, dim // 2]
        shape[axis] = size
        angles.append(axis_angles.reshape(shape).expand(*grid, dim // 2))
    angles_LP = torch.cat(angles, dim=-1).reshape(-1, head_dim // 2)  # P = head_dim/2 pairs
    return angles_LP.cos(), angles_LP.sin()


def sequence_rope(
    length: int, head_dim: int, *, device: torch.device | str | None = None, theta: float = ROPE_THETA
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of plain 1D RoPE at positions 0..length-1, each [length, head_dim/2] fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles_LP = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv_freq)
    return angles_LP.cos(), angles_LP.sin()


def apply_rope(x_BHLD: torch.Tensor, cos_LP: torch.Tensor, sin_LP: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (j, j + D/2) of x [..., L, D] by the angles whose cos/sin are [L, D/2].

    The rotation runs in the wider of x's and cos's dtypes and is cast back to x's dtype: pass
    fp32 cos/sin to rotate in fp32 (the DiT, as ComfyUI does), or cos/sin already cast to x's
    dtype to rotate in that dtype (the LLM adapter, as ComfyUI and diffusers do).
    """
    half = x_BHLD.shape[-1] // 2
    x1, x2 = x_BHLD[..., :half], x_BHLD[..., half:]
    out = torch.cat([x1 * cos_LP - x2 * sin_LP, x2 * cos_LP + x1 * sin_LP], dim=-1)
    return out.to(x_BHLD.dtype)
