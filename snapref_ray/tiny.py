"""`snapref-ray make-tiny DIR`: a complete tiny model set in the real file layouts.

The files go through exactly the loaders the real ones do (same key names, prefixes and
tensor ranks; only the widths are small), so tests and the demo exercise the real code paths
on a CPU in seconds. Tiny models draw noise: they prove the plumbing, not the pictures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import save_file

from snapref_ray.adapter.arcanima import make_arcanima, save_arcanima
from snapref_ray.adapter.file import save_adapter
from snapref_ray.adapter.generate import make_adapter
from snapref_ray.models.tiny_dit import make_tiny_dit_state_dict
from snapref_ray.models.tiny_text import (
    TINY_QWEN_VOCAB,
    TINY_T5_VOCAB,
    make_tiny_qwen3_state_dict,
    write_tiny_tokenizers,
)
from snapref_ray.models.tiny_vae import make_tiny_vae_state_dict


@dataclass(frozen=True)
class TinyConfig:
    """Sizes of the tiny set; widths divide evenly so every real code path (GQA, RoPE split) runs."""

    model_channels: int = 64
    num_blocks: int = 2
    head_dim: int = 32
    text_dim: int = 64  # Qwen3 hidden = LLM adapter width = DiT context width (in_proj is identity)
    vae_base_dim: int = 4
    ref_rank: int = 8
    target_rank: int = 4
    seed: int = 0
    # ArcAnima LoRA rank; None = the published one (64 for v2, 32 for the pilot).
    arcanima_rank: int | None = None


ADAPTER_KINDS = ("snapref", "arcanima-v2", "arcanima-pilot")


def _contiguous(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in sd.items()}


def make_tiny(
    out_dir: str | Path, config: TinyConfig = TinyConfig(), *, with_adapter: bool = True, adapter_kind: str = "snapref"
) -> Path:
    """Write dit / text_encoder / vae / adapter .safetensors and tokenizers/{qwen,t5} into `out_dir`.

    adapter_kind: "snapref" (anima_ref_kv/1), "arcanima-v2" or "arcanima-pilot" (a ComfyUI-keyed
    LoRA file with this project's `adapter_kind` metadata).
    """
    if adapter_kind not in ADAPTER_KINDS:
        raise ValueError(f"adapter_kind must be one of {', '.join(ADAPTER_KINDS)}, found {adapter_kind!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dit = make_tiny_dit_state_dict(
        model_channels=config.model_channels,
        num_blocks=config.num_blocks,
        head_dim=config.head_dim,
        context_dim=config.text_dim,
        adapter_dim=config.text_dim,
        t5_vocab=TINY_T5_VOCAB,
        seed=config.seed,
    )
    save_file(_contiguous({f"net.{k}": v for k, v in dit.items()}), str(out / "dit.safetensors"))

    qwen = make_tiny_qwen3_state_dict(hidden=config.text_dim, vocab=TINY_QWEN_VOCAB, seed=config.seed)
    qwen = {(k if k.startswith("model.") else f"model.{k}"): v for k, v in qwen.items()}
    save_file(_contiguous(qwen), str(out / "text_encoder.safetensors"))

    vae = make_tiny_vae_state_dict(base_dim=config.vae_base_dim, seed=config.seed)
    save_file(_contiguous(vae), str(out / "vae.safetensors"))

    write_tiny_tokenizers(out / "tokenizers" / "qwen", out / "tokenizers" / "t5")

    if with_adapter:
        write_tiny_adapter(out / "adapter.safetensors", config, adapter_kind)
    write_tiny_lora(out / "style-lora.safetensors", config)
    _write_example_reference(out / "reference.png", config.seed)
    return out


def write_tiny_lora(path: str | Path, config: TinyConfig = TinyConfig(), *, rank: int = 4, scale: float = 0.3) -> Path:
    """A plain (style) LoRA for the tiny DiT in ComfyUI's key layout, on two linears: what `--lora` merges."""
    g = torch.Generator().manual_seed(config.seed + 7)
    width, hidden = config.model_channels, 4 * config.model_channels
    sd = {}
    for module, (fan_in, fan_out) in {
        "blocks.0.self_attn.q_proj": (width, width),
        f"blocks.{config.num_blocks - 1}.mlp.layer2": (hidden, width),
    }.items():
        sd[f"diffusion_model.{module}.lora_down.weight"] = torch.randn(rank, fan_in, generator=g) * scale
        sd[f"diffusion_model.{module}.lora_up.weight"] = torch.randn(fan_out, rank, generator=g) * scale
    save_file(sd, str(path))
    return Path(path)


def write_tiny_adapter(
    path: str | Path, config: TinyConfig = TinyConfig(), adapter_kind: str = "snapref", num_blocks: int | None = None
) -> Path:
    """A random adapter of `adapter_kind` for the tiny DiT of `config` (fp32)."""
    num_blocks = num_blocks or config.num_blocks
    if adapter_kind != "snapref":
        arc = make_arcanima(
            adapter_kind,
            num_blocks=num_blocks,
            model_channels=config.model_channels,
            context_dim=config.text_dim,
            mlp_hidden=4 * config.model_channels,
            rank=config.arcanima_rank,
            seed=config.seed,
            scale=0.3,
        )
        save_arcanima(arc, path, dtype=torch.float32)
        return Path(path)
    adapter = make_adapter(
        num_blocks=num_blocks,
        model_channels=config.model_channels,
        context_dim=config.text_dim,
        mlp_hidden=4 * config.model_channels,
        ref_rank=config.ref_rank,
        target_rank=config.target_rank,
        init="random",
        seed=config.seed,
        base_model="anima-tiny",
    )
    save_adapter(adapter, path, weight_format="fp32")
    return Path(path)


def _write_example_reference(path: Path, seed: int) -> None:
    """A small synthetic 'character sheet' so the demo has a reference without downloads."""
    g = torch.Generator().manual_seed(seed)
    h, w = 192, 128
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, h), torch.linspace(-1, 1, w), indexing="ij")
    body = ((xx / 0.45) ** 2 + ((yy - 0.25) / 0.7) ** 2 < 1).float()
    head = ((xx / 0.3) ** 2 + ((yy + 0.55) / 0.3) ** 2 < 1).float()
    colour = torch.rand(3, generator=g)
    rgb = torch.stack([0.95 - 0.6 * body * colour[i] - 0.3 * head * (1 - colour[i]) for i in range(3)], dim=-1)
    Image.fromarray((rgb.clamp(0, 1) * 255).to(torch.uint8).numpy()).save(path)
