"""Identity by an image-embedding model the user has on disk: similarity of a render to its reference.

Two families, both loaded once per render service and never downloaded:
- `transformers` image models saved by `save_pretrained` (DINOv2, CLIP, SigLIP): `AutoModel` and
  `AutoImageProcessor` with `local_files_only=True`; the embedding is `get_image_features` where the
  model has one (CLIP and SigLIP: the projected pooled output), else its `pooler_output` (DINOv2: the
  layer-normed CLS token). The score is the cosine similarity.
- CCIP, the anime character-identity model of `dghs-imgutils` (an optional install: the
  `judge-embedding` extra), from the Hugging Face cache with the hub offline; the score is
  1 - its feature difference, so that higher means "the same character" in both families.

A reference of several images scores the best match (one character seen several ways); a pair of two
characters the worse of the two (both must be drawn).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from PIL import Image

from snapref_ray.render_service.judges.spec import EmbeddingCheck
from snapref_ray.requests import RenderError


class Embedder(Protocol):
    def features(self, images: Sequence[Image.Image]) -> np.ndarray:
        """[N, D] features of the images, batched."""

    def similarity(self, a_ND: np.ndarray, b_MD: np.ndarray) -> np.ndarray:
        """[N, M] similarity (higher: more alike) of every feature of `a` with every one of `b`."""


class TransformersEmbedder:
    """A `transformers` image model from a local folder (see the module docstring)."""

    def __init__(self, folder: str, device) -> None:
        import torch
        from transformers import AutoImageProcessor, AutoModel

        if not os.path.isdir(folder):
            raise RenderError(
                f"embedding model {folder!r} is not a folder: give a local folder written by save_pretrained"
                " (nothing is downloaded)",
                field="judge.embedding.model",
            )
        try:
            self.processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
            model = AutoModel.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError) as e:
            raise RenderError(f"embedding model {folder}: {e}", field="judge.embedding.model") from None
        self.model = model.to(device=device, dtype=torch.float32).eval()
        self.device = device

    def features(self, images: Sequence[Image.Image]) -> np.ndarray:
        import torch

        inputs = self.processor(images=[image.convert("RGB") for image in images], return_tensors="pt")
        pixel_values = inputs["pixel_values"].to(self.device, torch.float32)
        with torch.inference_mode():
            if hasattr(self.model, "get_image_features"):  # CLIP, SigLIP: the projected pooled output
                out = self.model.get_image_features(pixel_values=pixel_values)
            else:  # DINOv2 and other vision backbones: the pooled (CLS) output
                out = self.model(pixel_values=pixel_values)
            feats_ND = out if isinstance(out, torch.Tensor) else out.pooler_output
        return feats_ND.float().cpu().numpy()

    def similarity(self, a_ND: np.ndarray, b_MD: np.ndarray) -> np.ndarray:
        a = a_ND / np.linalg.norm(a_ND, axis=1, keepdims=True)
        b = b_MD / np.linalg.norm(b_MD, axis=1, keepdims=True)
        return a @ b.T


class CCIPEmbedder:
    """`imgutils`' CCIP (character identity) model, by name, from the Hugging Face cache only."""

    def __init__(self, model: str) -> None:
        try:
            from imgutils.metrics import ccip_batch_extract_features, ccip_difference
        except ImportError:
            raise RenderError(
                "embedding kind ccip needs the `dghs-imgutils` package, which is not installed: pip install"
                " 'snapref-ray[judge-embedding]' (or dghs-imgutils), with its CCIP model in the Hugging Face cache",
                field="judge.embedding.kind",
            ) from None
        self.model = model
        self._extract = ccip_batch_extract_features
        self._difference = ccip_difference

    def features(self, images: Sequence[Image.Image]) -> np.ndarray:
        with _hub_offline():
            return np.asarray(self._extract(list(images), model=self.model))

    def similarity(self, a_ND: np.ndarray, b_MD: np.ndarray) -> np.ndarray:
        with _hub_offline():
            return np.array([[1.0 - float(self._difference(a, b, model=self.model)) for b in b_MD] for a in a_ND])


@contextlib.contextmanager
def _hub_offline():
    """The Hugging Face hub offline while CCIP loads: its model comes from the cache or not at all."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before


def load_embedder(check: EmbeddingCheck, device) -> Embedder:
    """The embedder `check` names (loaded here: the caller keeps it for the next batch)."""
    if check.kind == "ccip":
        return CCIPEmbedder(check.model)
    return TransformersEmbedder(check.model, device)


def reference_images(files: Sequence[bytes]) -> list[Image.Image]:
    return [Image.open(io.BytesIO(data)).convert("RGB") for data in files]


def score_embedding(
    embedder: Embedder, images: Sequence[Image.Image], reference_feats_MD: np.ndarray, layout: str
) -> list[dict[str, float]]:
    """Per image: `embedding`, its similarity to the reference (best image; the worse character of a pair)."""
    sims_NM = embedder.similarity(embedder.features(images), reference_feats_MD)
    per_image = sims_NM.min(axis=1) if layout == "pair" else sims_NM.max(axis=1)
    return [{"embedding": float(s)} for s in per_image]


def embedding_passes(scores: dict, check: EmbeddingCheck) -> bool:
    return scores["embedding"] >= check.min_similarity
