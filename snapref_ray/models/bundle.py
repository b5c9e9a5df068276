"""Where the files of a model set live: one folder, tiny or real, local (s3:// is resolved by the caller).

Two naming conventions are accepted so that users can point at the folder they already have:
- the names `snapref-ray make-tiny` writes: dit.safetensors, text_encoder.safetensors, vae.safetensors,
  adapter.safetensors, tokenizers/qwen/, tokenizers/t5/;
- the ComfyUI split-file names: anima-*.safetensors (or any *.safetensors holding the DiT),
  qwen_3_06b_base.safetensors, qwen_image_vae.safetensors, with tokenizer folders qwen/ (or
  qwen25_tokenizer/) and t5/ (or t5_tokenizer/) next to them or under tokenizers/.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class ModelFilesError(FileNotFoundError):
    """A model folder lacks a file; the message lists what was looked for."""


@dataclass(frozen=True)
class ModelFiles:
    """Paths of everything a Renderer loads."""

    dit: Path
    text_encoder: Path
    vae: Path
    qwen_tokenizer: Path
    t5_tokenizer: Path
    adapter: Path | None = None


_CANDIDATES = {
    "dit": [
        "dit.safetensors",
        "anima-base-v1.0.safetensors",
        "anima*.safetensors",
        "diffusion_models/anima*.safetensors",
    ],
    "text_encoder": [
        "text_encoder.safetensors",
        "qwen_3_06b_base.safetensors",
        "qwen*3*.safetensors",
        "text_encoders/qwen_3_06b_base.safetensors",
    ],
    "vae": ["vae.safetensors", "qwen_image_vae.safetensors", "*vae*.safetensors", "vae/qwen_image_vae.safetensors"],
    "qwen_tokenizer": ["tokenizers/qwen", "qwen", "qwen25_tokenizer", "tokenizers/qwen25_tokenizer"],
    "t5_tokenizer": ["tokenizers/t5", "t5", "t5_tokenizer", "tokenizers/t5_tokenizer"],
    "adapter": ["adapter.safetensors", "*snapref*.safetensors"],
}


ADAPTER_PATTERNS: tuple[str, ...] = tuple(_CANDIDATES["adapter"])


def _find(root: Path, patterns: list[str]) -> Path | None:
    for pattern in patterns:
        hits = sorted(p for p in root.glob(pattern) if p.exists())
        if hits:
            return hits[0]
    return None


def resolve_model_files(models_dir: str | Path) -> ModelFiles:
    """Find the DiT, text encoder, VAE, tokenizers (and an adapter, if any) in one folder."""
    root = Path(models_dir).expanduser()
    if not root.is_dir():
        raise ModelFilesError(
            f"model folder {root} does not exist (make a tiny set with `snapref-ray make-tiny {root}`)"
        )
    found: dict[str, Path | None] = {name: _find(root, pats) for name, pats in _CANDIDATES.items()}
    missing = [name for name, path in found.items() if path is None and name != "adapter"]
    if missing:
        wanted = "; ".join(f"{name}: one of {_CANDIDATES[name]}" for name in missing)
        raise ModelFilesError(f"model folder {root} lacks {', '.join(missing)} ({wanted})")
    return ModelFiles(**found)  # type: ignore[arg-type]
