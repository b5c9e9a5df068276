"""A float64 re-derivation of the Anima DiT for the ArcAnima tests, written from docs/design.md#dit.

Nothing here calls the production model: weights are read from the safetensors files with
`safe_open`, and patchify, timestep embedding, adaLN modulation, RMSNorm, 3D RoPE, attention,
the MLP, the final layer and unpatchify are written out again. Two entry points:

- `joint_v2_velocity`: ArcAnima v2 without any cache — ONE joint attention over
  [target tokens; reference tokens] per block with an explicit mask (reference queries see
  only reference keys and take no cross-attention; target queries of a reading row see both;
  a non-reading row sees its own tokens only), the reference tokens at timestep 0 and at RoPE
  positions shifted past the target grid, the LoRA (x strength) only in the reading rows'
  target tokens. The reference tokens are recomputed in every call.
- `frames_velocity`: a plain multi-frame forward (the pilot's two frames) with optional LoRA.
"""

from __future__ import annotations

import math

import torch
from safetensors import safe_open

F64 = torch.float64
EPS = 1e-6


def read_dit(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k.removeprefix("net."): f.get_tensor(k).to(F64) for k in f.keys()}


def read_lora_deltas(path) -> dict[str, torch.Tensor]:
    """{"blocks.N.<linear>": ΔW [out, in] float64} from ComfyUI-keyed LoRA factors (scale alpha / rank)."""
    with safe_open(str(path), framework="pt") as f:
        t = {k: f.get_tensor(k).to(F64) for k in f.keys()}
    deltas = {}
    for key in t:
        if key.endswith(".lora_down.weight"):
            stem = key[: -len(".lora_down.weight")]
            down, up = t[key], t[stem + ".lora_up.weight"]
            alpha = float(t[stem + ".alpha"]) if stem + ".alpha" in t else down.shape[0]
            deltas[stem.removeprefix("diffusion_model.")] = up @ down * (alpha / down.shape[0])
    return deltas


def patchify(x_BCTHW: torch.Tensor) -> torch.Tensor:
    """[B, C, T, H, W] (H, W even) -> [B, T*H/2*W/2, (C+1)*4], feature c*4 + m*2 + n for pixel (2i+m, 2j+n)."""
    B, C, T, H, W = x_BCTHW.shape
    x = torch.cat([x_BCTHW, torch.zeros(B, 1, T, H, W, dtype=x_BCTHW.dtype)], dim=1)
    out = torch.empty(B, T, H // 2, W // 2, (C + 1) * 4, dtype=x.dtype)
    for m in range(2):
        for n in range(2):
            out[..., m * 2 + n :: 4] = x[:, :, :, m::2, n::2].permute(0, 2, 3, 4, 1)
    return out.reshape(B, -1, (C + 1) * 4)


def unpatchify(y: torch.Tensor, T: int, Hp: int, Wp: int, C: int) -> torch.Tensor:
    """[B, T*Hp*Wp, 4C] with feature p1*2C + p2*C + c -> [B, C, T, 2Hp, 2Wp]."""
    B = y.shape[0]
    y = y.reshape(B, T, Hp, Wp, 4 * C)
    out = torch.empty(B, C, T, 2 * Hp, 2 * Wp, dtype=y.dtype)
    for p1 in range(2):
        for p2 in range(2):
            out[:, :, :, p1::2, p2::2] = y[..., p1 * 2 * C + p2 * C : p1 * 2 * C + (p2 + 1) * C].permute(0, 4, 1, 2, 3)
    return out


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt((x - mu).pow(2).mean(-1, keepdim=True) + EPS)


def rope_angles(positions: list[tuple[int, int, int]], head_dim: int) -> torch.Tensor:
    """[L, head_dim/2] angles: concat[t*w_t, h*w_h, w*w_w], NTK bases 10000*r^(d/(d-2)), r = (1, 4, 4)."""
    d_hw = head_dim // 6 * 2
    dims = (head_dim - 2 * d_hw, d_hw, d_hw)
    freqs = []
    for d, ratio in zip(dims, (1.0, 4.0, 4.0)):
        theta = 10000.0 * ratio ** (d / (d - 2))
        freqs.append(torch.tensor([theta ** (-2 * k / d) for k in range(d // 2)], dtype=F64))
    pos = torch.tensor(positions, dtype=F64)  # [L, 3]
    return torch.cat([pos[:, a : a + 1] * freqs[a][None] for a in range(3)], dim=1)


def rotate(x_HLD: torch.Tensor, angles_LP: torch.Tensor) -> torch.Tensor:
    half = x_HLD.shape[-1] // 2
    a, b = x_HLD[..., :half], x_HLD[..., half:]
    c, s = angles_LP.cos(), angles_LP.sin()
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def grid_positions(T: int, Hp: int, Wp: int, offset=(0, 0, 0)) -> list[tuple[int, int, int]]:
    return [(t + offset[0], h + offset[1], w + offset[2]) for t in range(T) for h in range(Hp) for w in range(Wp)]


class Oracle:
    def __init__(self, dit_path, lora_path=None) -> None:
        self.w = read_dit(dit_path)
        self.deltas = read_lora_deltas(lora_path) if lora_path is not None else {}
        self.D = self.w["x_embedder.proj.1.weight"].shape[0]
        self.head_dim = self.w["blocks.0.self_attn.q_norm.weight"].shape[0]
        self.heads = self.D // self.head_dim
        self.blocks = 1 + max(int(k.split(".")[1]) for k in self.w if k.startswith("blocks."))

    def lin(self, name: str, x: torch.Tensor, lora_mult: float = 0.0) -> torch.Tensor:
        W = self.w[name + ".weight"]
        if lora_mult and name in self.deltas:
            W = W + lora_mult * self.deltas[name]
        return x @ W.T

    def time(self, sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(e_n [D], A [3D]) for one sigma."""
        half = self.D // 2
        f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=F64) / half)
        e = torch.cat([torch.cos(sigma * f), torch.sin(sigma * f)])
        A = self.lin("t_embedder.1.linear_2", torch.nn.functional.silu(self.lin("t_embedder.1.linear_1", e)))
        return rms(e, self.w["t_embedding_norm.weight"]), A

    def mod(self, prefix: str, t, chunks: int) -> list[torch.Tensor]:
        e_n, A = t
        m = self.lin(prefix + ".2", self.lin(prefix + ".1", torch.nn.functional.silu(e_n))) + A[: chunks * self.D]
        return list(m.split(self.D))

    def heads_of(self, x_LD: torch.Tensor) -> torch.Tensor:
        return x_LD.reshape(x_LD.shape[0], self.heads, self.head_dim).transpose(0, 1)  # [H, L, d]

    def attend(self, q, k, v, mask_LK: torch.Tensor | None) -> torch.Tensor:
        logits = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        if mask_LK is not None:
            logits = logits.masked_fill(~mask_LK, float("-inf"))
        return (logits.softmax(-1) @ v).transpose(0, 1).reshape(q.shape[1], -1)

    def run(self, tokens: torch.Tensor, groups: list[dict], context: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Run the blocks over one row's tokens [L, D].

        groups: token ranges, each {"slice", "t" (time), "lora" (multiplier), "cross" (bool), "angles"}.
        mask [L, L]: which keys each query sees.
        """
        x = tokens
        angles = torch.cat([g["angles"] for g in groups])
        for i in range(self.blocks):
            p = f"blocks.{i}"

            def per_group(fn, x=None):
                return torch.cat([fn(x[g["slice"]], g) for g in groups])

            def sa_inputs(xg, g):
                shift, scale, _ = self.mod(f"{p}.adaln_modulation_self_attn", g["t"], 3)
                return layer_norm(xg) * (1 + scale) + shift

            h = [sa_inputs(x[g["slice"]], g) for g in groups]
            q = torch.cat([self.lin(f"{p}.self_attn.q_proj", hg, g["lora"]) for hg, g in zip(h, groups)])
            k = torch.cat([self.lin(f"{p}.self_attn.k_proj", hg, g["lora"]) for hg, g in zip(h, groups)])
            v = torch.cat([self.lin(f"{p}.self_attn.v_proj", hg, g["lora"]) for hg, g in zip(h, groups)])
            q = rotate(rms(self.heads_of(q), self.w[f"{p}.self_attn.q_norm.weight"]), angles)
            k = rotate(rms(self.heads_of(k), self.w[f"{p}.self_attn.k_norm.weight"]), angles)
            o = self.attend(q, k, self.heads_of(v), mask)
            x = x + torch.cat(
                [
                    self.mod(f"{p}.adaln_modulation_self_attn", g["t"], 3)[2]
                    * self.lin(f"{p}.self_attn.output_proj", o[g["slice"]], g["lora"])
                    for g in groups
                ]
            )

            def cross(xg, g):
                if not g["cross"]:
                    return torch.zeros_like(xg)
                shift, scale, gate = self.mod(f"{p}.adaln_modulation_cross_attn", g["t"], 3)
                hg = layer_norm(xg) * (1 + scale) + shift
                qc = rms(
                    self.heads_of(self.lin(f"{p}.cross_attn.q_proj", hg, g["lora"])),
                    self.w[f"{p}.cross_attn.q_norm.weight"],
                )
                kc = rms(
                    self.heads_of(self.lin(f"{p}.cross_attn.k_proj", context, g["lora"])),
                    self.w[f"{p}.cross_attn.k_norm.weight"],
                )
                vc = self.heads_of(self.lin(f"{p}.cross_attn.v_proj", context, g["lora"]))
                return gate * self.lin(f"{p}.cross_attn.output_proj", self.attend(qc, kc, vc, None), g["lora"])

            x = x + per_group(cross, x)

            def mlp(xg, g):
                shift, scale, gate = self.mod(f"{p}.adaln_modulation_mlp", g["t"], 3)
                hg = layer_norm(xg) * (1 + scale) + shift
                hidden = torch.nn.functional.gelu(self.lin(f"{p}.mlp.layer1", hg, g["lora"]))
                return gate * self.lin(f"{p}.mlp.layer2", hidden, g["lora"])

            x = x + per_group(mlp, x)
        return x

    def final(self, x_LD: torch.Tensor, t) -> torch.Tensor:
        shift, scale = self.mod("final_layer.adaln_modulation", t, 2)
        return self.lin("final_layer.linear", layer_norm(x_LD) * (1 + scale) + shift)

    # -- entry points ---------------------------------------------------------------------------
    def joint_v2_velocity(
        self,
        x_B: torch.Tensor,
        sigma: float,
        contexts: list[torch.Tensor],
        reads: list[bool],
        ref_latent: torch.Tensor,
        strength: float,
    ) -> torch.Tensor:
        """x_B [B, 16, 1, H, W]; ref_latent [1, 16, h, w]; contexts[b] [S, C]. Returns v [B, 16, 1, H, W]."""
        B, C, _, H, W = x_B.shape
        Hp, Wp = H // 2, W // 2
        hr, wr = ref_latent.shape[-2] // 2, ref_latent.shape[-1] // 2
        Lt, Lr = Hp * Wp, hr * wr
        target_tokens = patchify(x_B.to(F64)) @ self.w["x_embedder.proj.1.weight"].T
        ref_tokens = patchify(ref_latent.to(F64).unsqueeze(2)) @ self.w["x_embedder.proj.1.weight"].T
        t_target, t_ref = self.time(sigma), self.time(0.0)
        angles_t = rope_angles(grid_positions(1, Hp, Wp), self.head_dim)
        angles_r = rope_angles(grid_positions(1, hr, wr, (0, Hp, Wp)), self.head_dim)  # past the target grid
        out = []
        for b in range(B):
            ctx = contexts[b].to(F64)
            if reads[b]:
                mask = torch.zeros(Lt + Lr, Lt + Lr, dtype=torch.bool)
                mask[:Lt, :] = True  # target queries: target + reference keys
                mask[Lt:, Lt:] = True  # reference queries: reference keys only
                groups = [
                    dict(slice=slice(0, Lt), t=t_target, lora=strength, cross=True, angles=angles_t),
                    dict(slice=slice(Lt, Lt + Lr), t=t_ref, lora=0.0, cross=False, angles=angles_r),
                ]
                x = self.run(torch.cat([target_tokens[b], ref_tokens[0]]), groups, ctx, mask)[:Lt]
            else:
                groups = [dict(slice=slice(0, Lt), t=t_target, lora=0.0, cross=True, angles=angles_t)]
                x = self.run(target_tokens[b], groups, ctx, None)
            out.append(unpatchify(self.final(x, t_target)[None], 1, Hp, Wp, C)[0])
        return torch.stack(out)

    def frames_velocity(
        self, x_BCTHW: torch.Tensor, sigma: float, context: torch.Tensor, lora_mult: float
    ) -> torch.Tensor:
        """A plain forward of one row [1, 16, T, H, W] with every token using the LoRA x lora_mult."""
        _, C, T, H, W = x_BCTHW.shape
        Hp, Wp = H // 2, W // 2
        tokens = patchify(x_BCTHW.to(F64))[0] @ self.w["x_embedder.proj.1.weight"].T
        t = self.time(sigma)
        groups = [
            dict(
                slice=slice(0, tokens.shape[0]),
                t=t,
                lora=lora_mult,
                cross=True,
                angles=rope_angles(grid_positions(T, Hp, Wp), self.head_dim),
            )
        ]
        x = self.run(tokens, groups, context.to(F64), None)
        return unpatchify(self.final(x, t)[None], T, Hp, Wp, C)
