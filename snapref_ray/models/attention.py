"""The one attention function of the DiT's self-attention, and the reference read behind it.

Every self-attention call in the DiT goes through `attention()`. Without a `RefRead` it is plain
scaled-dot-product attention. With one, the rows named in `RefRead.rows` attend over the
target's keys plus the cached reference keys of this block, with the reference keys' attention
mass multiplied by `weight` (logits + log(weight)); the other rows attend over the target alone.
The CFG batch therefore stays one forward: only this function sees which rows read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RefRead:
    """What one block's self-attention reads from a reference.

    k_HLD / v_HLD: the reference keys (after q/k-norm and RoPE at the reference positions) and
    values for this block, [heads, ref_tokens, head_dim], shared by every reading row.
    rows: bool [B], True for batch rows that read the reference.
    weight: ref_weight x the mode's block weight; 1 is the trained behaviour, 0 reads nothing.
    """

    k_HLD: torch.Tensor
    v_HLD: torch.Tensor
    rows: torch.Tensor
    weight: float = 1.0


def sdpa(q_BHLD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention, the one backend call (PyTorch SDPA, as ComfyUI's default)."""
    return F.scaled_dot_product_attention(q_BHLD, k_BHLD, v_BHLD, attn_mask=bias)


def _attend_with_reference(q_BHLD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor,
                           ref: RefRead) -> torch.Tensor:
    B = q_BHLD.shape[0]
    ref_k = ref.k_HLD.to(q_BHLD.dtype).unsqueeze(0).expand(B, -1, -1, -1)
    ref_v = ref.v_HLD.to(v_BHLD.dtype).unsqueeze(0).expand(B, -1, -1, -1)
    k_cat = torch.cat([k_BHLD, ref_k], dim=2)  # [B, H, Lt + Lr, D]
    v_cat = torch.cat([v_BHLD, ref_v], dim=2)
    bias = None
    if ref.weight != 1.0:
        # Multiplying a key's attention mass by w is adding log(w) to its logit.
        Lt, Lr = k_BHLD.shape[2], ref_k.shape[2]
        bias = torch.zeros(1, Lt + Lr, dtype=q_BHLD.dtype, device=q_BHLD.device)  # broadcast over queries
        bias[:, Lt:] = math.log(ref.weight)
    return sdpa(q_BHLD, k_cat, v_cat, bias)


def attention(q_BHLD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor,
              ref: RefRead | None = None) -> torch.Tensor:
    """Self-attention of the target tokens, optionally reading a reference; returns [B, L, H*D].

    q, k are already normalised and rotated (RoPE); v is as projected.
    """
    B, H, L, D = q_BHLD.shape
    if ref is None or ref.weight <= 0.0 or not bool(ref.rows.any()):
        out_BHLD = sdpa(q_BHLD, k_BHLD, v_BHLD)
    elif bool(ref.rows.all()):
        out_BHLD = _attend_with_reference(q_BHLD, k_BHLD, v_BHLD, ref)
    else:
        # Rows that read and rows that don't need different key sets: attend in two groups and
        # scatter back, so the non-reading rows pay nothing for the reference.
        rows = ref.rows.to(q_BHLD.device)
        out_BHLD = torch.empty_like(q_BHLD)
        out_BHLD[~rows] = sdpa(q_BHLD[~rows], k_BHLD[~rows], v_BHLD[~rows])
        out_BHLD[rows] = _attend_with_reference(q_BHLD[rows], k_BHLD[rows], v_BHLD[rows], ref)
    return out_BHLD.transpose(1, 2).reshape(B, L, H * D)
