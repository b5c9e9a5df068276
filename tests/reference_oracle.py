"""A float64 oracle for SnapRef's reference read, written from docs/design.md alone.

It shares no code with `snapref_ray.models` or the reference cache: the weights come straight
from the safetensors files, the Anima DiT (docs/design.md#dit) is re-written here in a few plain
functions, and the reference is read *fresh* at every call — per block ONE attention over the
joint sequence [target tokens; reference tokens] with an explicit mask (docs/design.md#snapref-cached-reference-kv):

- reference tokens run at σ = 0 with the reference LoRA branch and their own caption context, at
  their own RoPE offset, and see only the tokens of their own reference;
- target tokens run at the step's σ with the target LoRA branch and see their own tokens plus,
  in rows that read, every reference token — whose probability mass is multiplied by
  ref_weight x the mode's block weight before the softmax is normalised (explicitly, not as a
  logit bias);
- rows that do not read see only the target.

Nothing is cached: the reference stream is recomputed inside every target forward.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

F64 = torch.float64
EPS = 1e-6
# Anima-2.9B: the model block each block of a 28-block adapter attaches to
# (docs/design.md#deeper-models-28-to-40-blocks).
INHERITED_40 = (0, 1, 3, 4, 6, 7, 9, 10, 12, 13, 15, 16, 18, 19, 20, 22, 23, 25, 26, 28, 29, 31, 32, 34, 35, 37, 38, 39)
REF_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.output_proj",
    "cross_attn.q_proj",
    "cross_attn.k_proj",
    "cross_attn.v_proj",
    "cross_attn.output_proj",
    "mlp.layer1",
    "mlp.layer2",
)


# --- weights, read from the files -------------------------------------------------------------


def load_dit_weights(path: Path) -> dict[str, torch.Tensor]:
    sd = load_file(str(path))
    return {k.removeprefix("net."): v.to(F64) for k, v in sd.items()}


@dataclass
class OracleAdapter:
    """The adapter as the file states it, laid out per MODEL block (None: no branch on that block)."""

    ref: list[dict[str, tuple[torch.Tensor, torch.Tensor, float]] | None]
    target: list[dict[str, tuple[torch.Tensor, torch.Tensor, float]] | None]
    block_weight: list[float]  # the mode's weight per model block
    rope_offset: list  # as in the file: ints or "after_target"


def load_adapter_weights(path: Path, model_blocks: int, mode: str) -> OracleAdapter:
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    sd = load_file(str(path))
    n = int(meta["num_blocks"])
    ref_scale = float(meta.get("ref_alpha", meta["ref_rank"])) / int(meta["ref_rank"])
    target_scale = float(meta.get("target_alpha", meta["target_rank"])) / int(meta["target_rank"])
    hooked = list(range(n)) if n == model_blocks else list(INHERITED_40)
    assert (n, model_blocks) in {(n, n), (28, 40)}

    def pair(branch: str, k: int, linear: str, scale: float):
        base = f"{branch}.blocks.{k}.{linear}"
        return sd[f"{base}.lora_down.weight"].to(F64), sd[f"{base}.lora_up.weight"].to(F64), scale

    ref: list = [None] * model_blocks
    target: list = [None] * model_blocks
    for k, block in enumerate(hooked):
        ref[block] = {lin: pair("ref", k, lin, ref_scale) for lin in REF_LINEARS}
        target[block] = {"self_attn.q_proj": pair("target", k, "self_attn.q_proj", target_scale)}
    per_adapter_block = sd[f"modes.{mode}.block_weight"].to(F64).tolist()
    # Inserted blocks (no adapter block) read with the weight of the last inherited block before them.
    weights, last = [], per_adapter_block[0]
    for block in range(model_blocks):
        if block in hooked:
            last = per_adapter_block[hooked.index(block)]
        weights.append(last)
    return OracleAdapter(ref, target, weights, json.loads(meta["ref_rope_offset"]))


# --- the Anima DiT, from docs/design.md#dit --------------------------------------------------------


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + EPS)


def linear(sd: dict, name: str, x: torch.Tensor, lora: dict | None = None, key: str | None = None) -> torch.Tensor:
    y = x @ sd[f"{name}.weight"].T
    if lora is not None and key in lora:
        down, up, scale = lora[key]
        y = y + (x @ down.T) @ up.T * scale
    return y


def time_terms(sd: dict, sigma: float, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalised sinusoid e_n [D], shared adaLN-LoRA term A [3D]) of one σ."""
    k = torch.arange(D // 2, dtype=F64)
    f = torch.exp(-math.log(10000.0) * k / (D // 2))
    e = torch.cat([torch.cos(sigma * f), torch.sin(sigma * f)])
    a = linear(sd, "t_embedder.1.linear_2", F.silu(linear(sd, "t_embedder.1.linear_1", e)))
    return rms_norm(e, sd["t_embedding_norm.weight"]), a


def modulation(sd: dict, prefix: str, e_n: torch.Tensor, a: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    m = linear(sd, f"{prefix}.2", linear(sd, f"{prefix}.1", F.silu(e_n))) + a[: chunks * e_n.shape[0]]
    return list(m.chunk(chunks))


@functools.lru_cache(maxsize=64)
def rope_angles(Hp: int, Wp: int, head_dim: int, offset: tuple[int, int, int]) -> torch.Tensor:
    """[Hp*Wp, head_dim/2] angles of tokens (0 + dt, i + dh, j + dw), docs/design.md#rope (t ratio 1, h/w ratio 4)."""
    d_hw = head_dim // 6 * 2
    d_t = head_dim - 2 * d_hw
    out = []
    for i in range(Hp):
        for j in range(Wp):
            row = []
            for pos, dim, ratio in ((offset[0], d_t, 1.0), (i + offset[1], d_hw, 4.0), (j + offset[2], d_hw, 4.0)):
                theta = 10000.0 * ratio ** (dim / (dim - 2))
                row += [pos * theta ** (-2.0 * kk / dim) for kk in range(dim // 2)]
            out.append(row)
    return torch.tensor(out, dtype=F64)


def rotate(x_LHD: torch.Tensor, angles_LP: torch.Tensor) -> torch.Tensor:
    half = x_LHD.shape[-1] // 2
    cos, sin = angles_LP.cos()[:, None], angles_LP.sin()[:, None]
    a, b = x_LHD[..., :half], x_LHD[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def patch_tokens(x_CHW: torch.Tensor) -> torch.Tensor:
    """[16, H, W] (H, W even) -> [Hp*Wp, 68], feature c*4 + m*2 + n, with the zero mask channel 16."""
    C, H, W = x_CHW.shape
    x = torch.cat([x_CHW, torch.zeros(1, H, W, dtype=x_CHW.dtype)])
    return x.reshape(C + 1, H // 2, 2, W // 2, 2).permute(1, 3, 0, 2, 4).reshape((H // 2) * (W // 2), (C + 1) * 4)


def unpatch(y_LF: torch.Tensor, Hp: int, Wp: int) -> torch.Tensor:
    """[Hp*Wp, 64] with feature p1*32 + p2*16 + c -> [16, 2Hp, 2Wp]."""
    return y_LF.reshape(Hp, Wp, 2, 2, 16).permute(4, 0, 2, 1, 3).reshape(16, 2 * Hp, 2 * Wp)


@dataclass
class Stream:
    """One token group of the joint sequence: its residual, time terms, context, LoRA, RoPE angles."""

    x: torch.Tensor  # [L, D]
    e_n: torch.Tensor
    a: torch.Tensor
    context: torch.Tensor  # [S, Cctx]
    angles: torch.Tensor  # [L, head_dim/2]
    lora_of_block: list


def dit_velocity_fresh(
    sd: dict,
    config: dict,
    x_CHW: torch.Tensor,
    sigma: float,
    context: torch.Tensor,
    refs: Sequence[torch.Tensor],
    ref_context: torch.Tensor,
    adapter: OracleAdapter | None,
    read_weight: float | None,
) -> torch.Tensor:
    """The velocity of one target row, reading `refs` (normalised latents [16, h, w]) fresh when
    read_weight is not None (ref_weight; the mode's per-block weights come from `adapter`)."""
    D, heads, hd = config["D"], config["heads"], config["head_dim"]
    H, W = x_CHW.shape[-2:]
    Hp, Wp = H // 2, W // 2
    e_n, a = time_terms(sd, sigma, D)
    target = Stream(
        linear(sd, "x_embedder.proj.1", patch_tokens(x_CHW)),
        e_n,
        a,
        context,
        rope_angles(Hp, Wp, hd, (0, 0, 0)),
        adapter.target if adapter is not None else [None] * config["blocks"],
    )
    streams = [target]
    reading = read_weight is not None
    if reading:
        e0, a0 = time_terms(sd, 0.0, D)
        # "after_target" = the target grid's size on that axis; each next reference further along w.
        dt, dh, dw = (
            size if off == "after_target" else int(off) for off, size in zip(adapter.rope_offset, (1, Hp, Wp))
        )
        for ref in refs:
            rh, rw = ref.shape[-2] // 2, ref.shape[-1] // 2
            streams.append(
                Stream(
                    linear(sd, "x_embedder.proj.1", patch_tokens(ref)),
                    e0,
                    a0,
                    ref_context,
                    rope_angles(rh, rw, hd, (int(dt), int(dh), int(dw))),
                    adapter.ref,
                )
            )
            dw += rw

    for blk in range(config["blocks"]):
        p = f"blocks.{blk}"
        qs, ks, vs, gates = [], [], [], []
        for s in streams:
            sh, sc, g = modulation(sd, f"{p}.adaln_modulation_self_attn", s.e_n, s.a, 3)
            h = layer_norm(s.x) * (1 + sc) + sh
            lora = s.lora_of_block[blk]
            L = h.shape[0]
            q = rms_norm(
                linear(sd, f"{p}.self_attn.q_proj", h, lora, "self_attn.q_proj").view(L, heads, hd),
                sd[f"{p}.self_attn.q_norm.weight"],
            )
            k = rms_norm(
                linear(sd, f"{p}.self_attn.k_proj", h, lora, "self_attn.k_proj").view(L, heads, hd),
                sd[f"{p}.self_attn.k_norm.weight"],
            )
            v = linear(sd, f"{p}.self_attn.v_proj", h, lora, "self_attn.v_proj").view(L, heads, hd)
            qs.append(rotate(q, s.angles))
            ks.append(rotate(k, s.angles))
            vs.append(v)
            gates.append(g)
        # One attention over the joint sequence, with an explicit mass multiplier per (query, key).
        sizes = [q.shape[0] for q in qs]
        q_all, k_all, v_all = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        mass = torch.zeros(sum(sizes), sum(sizes), dtype=F64)  # 0 = masked out
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        for si, li in zip(starts, sizes):
            mass[si : si + li, si : si + li] = 1.0  # every stream sees itself
        if reading:
            w = read_weight * adapter.block_weight[blk]
            mass[: sizes[0], sizes[0] :] = w  # target queries see every reference key, mass times w
        logits = torch.einsum("qhd,khd->hqk", q_all, k_all) / math.sqrt(hd)
        unnorm = torch.exp(logits - logits.amax(-1, keepdim=True)) * mass
        probs = unnorm / unnorm.sum(-1, keepdim=True)
        out = torch.einsum("hqk,khd->qhd", probs, v_all).reshape(sum(sizes), heads * hd)
        for s, si, li, g in zip(streams, starts, sizes, gates):
            o = linear(
                sd, f"{p}.self_attn.output_proj", out[si : si + li], s.lora_of_block[blk], "self_attn.output_proj"
            )
            s.x = s.x + g * o
        for s in streams:
            lora = s.lora_of_block[blk]
            sh, sc, g = modulation(sd, f"{p}.adaln_modulation_cross_attn", s.e_n, s.a, 3)
            h = layer_norm(s.x) * (1 + sc) + sh
            L, S = h.shape[0], s.context.shape[0]
            q = rms_norm(
                linear(sd, f"{p}.cross_attn.q_proj", h, lora, "cross_attn.q_proj").view(L, heads, hd),
                sd[f"{p}.cross_attn.q_norm.weight"],
            )
            k = rms_norm(
                linear(sd, f"{p}.cross_attn.k_proj", s.context, lora, "cross_attn.k_proj").view(S, heads, hd),
                sd[f"{p}.cross_attn.k_norm.weight"],
            )
            v = linear(sd, f"{p}.cross_attn.v_proj", s.context, lora, "cross_attn.v_proj").view(S, heads, hd)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd), dim=-1)
            o = torch.einsum("hqk,khd->qhd", att, v).reshape(L, heads * hd)
            s.x = s.x + g * linear(sd, f"{p}.cross_attn.output_proj", o, lora, "cross_attn.output_proj")
            sh, sc, g = modulation(sd, f"{p}.adaln_modulation_mlp", s.e_n, s.a, 3)
            h = layer_norm(s.x) * (1 + sc) + sh
            hidden = F.gelu(linear(sd, f"{p}.mlp.layer1", h, lora, "mlp.layer1"))
            s.x = s.x + g * linear(sd, f"{p}.mlp.layer2", hidden, lora, "mlp.layer2")

    sh, sc = modulation(sd, "final_layer.adaln_modulation", e_n, a, 2)
    y = linear(sd, "final_layer.linear", layer_norm(target.x) * (1 + sc) + sh)
    return unpatch(y, Hp, Wp)


def dit_config(sd: dict) -> dict:
    D = sd["x_embedder.proj.1.weight"].shape[0]
    hd = sd["blocks.0.self_attn.q_norm.weight"].shape[0]
    blocks = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    return {"D": D, "head_dim": hd, "heads": D // hd, "blocks": blocks}


def sample_euler_cfg(
    sd: dict,
    x0: torch.Tensor,
    sigmas: Sequence[float],
    cfg: float,
    conds: Sequence[torch.Tensor],
    uncond: torch.Tensor,
    refs: Sequence[torch.Tensor],
    ref_context: torch.Tensor,
    adapter: OracleAdapter | None,
    ref_weight: float | None,
) -> torch.Tensor:
    """Euler with CFG (docs/design.md#samplers); the cond row reads the reference, the uncond row does not
    (the default path, docs/design.md#which-rows-read-and-reference-guidance). x0: [B, 16, H, W]; conds[b]: [S, C]."""
    config = dit_config(sd)
    x = x0.clone()
    for i in range(len(sigmas) - 1):
        s = sigmas[i]
        out = []
        for b in range(x.shape[0]):
            d_c = x[b] - s * dit_velocity_fresh(sd, config, x[b], s, conds[b], refs, ref_context, adapter, ref_weight)
            d_u = x[b] - s * dit_velocity_fresh(sd, config, x[b], s, uncond, refs, ref_context, adapter, None)
            d = d_u + cfg * (d_c - d_u)
            out.append(x[b] + (x[b] - d) / s * (sigmas[i + 1] - s))
        x = torch.stack(out)
    return x
