"""What a render asks its judges: `JudgeSpec`, one typed settings block per check, each with its threshold.

The same model is a job spec's `judge:` section, `SnapRefRenderer(judge=...)`, `txt2img --judge` and the
endpoint's `judge` field, so a check's name and its settings mean the same at every door. A check that is
absent is not run; `{}` runs it with the defaults below, whose descriptions say why each is what it is
(docs/judging.md: how to pick a threshold from a pilot run's histograms). Torch-free: Serve's ingress
validates request bodies with it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

CheckName = Literal["sanity", "near_duplicate", "identity_gap", "embedding"]
CHECKS: tuple[CheckName, ...] = ("sanity", "near_duplicate", "identity_gap", "embedding")


class _Check(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SanityCheck(_Check):
    """Image sanity without weights: a broken render (NaN latents, a flat or black frame, blown-out pixels)."""

    max_nonfinite_fraction: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Largest fraction of the final latent's elements that may be NaN or infinite. 0: one is"
        " enough to reject, since a single NaN spreads through the VAE decode (the fp16 black image).",
    )
    min_channel_std: float = Field(
        2.0,
        ge=0.0,
        le=128.0,
        description="Smallest standard deviation (0-255 scale) the image's most varied colour channel must"
        " reach. A drawn scene has tens; a flat fill (a collapsed or NaN render) under 1; 2 leaves"
        " JPEG-like noise on a flat frame rejected and a pale line drawing kept.",
    )
    min_mean_luminance: float = Field(
        8.0,
        ge=0.0,
        le=255.0,
        description="Smallest mean luminance (Rec. 601, 0-255) of the image. A NaN latent decodes to black"
        " (0); a night scene keeps its highlights and stays well above 8.",
    )
    max_clipped_fraction: float = Field(
        0.9,
        ge=0.0,
        le=1.0,
        description="Largest fraction of channel values at 0 or 255. Anime art has large pure-white"
        " backgrounds (a character on white can clip over half of its values), so only an almost wholly"
        " saturated frame is rejected.",
    )


class NearDuplicateCheck(_Check):
    """Near-duplicates within one reference's kept images, by 64-bit perceptual hash (`imagehash.phash`)."""

    max_distance: int = Field(
        6,
        ge=-1,
        le=64,
        description="An image whose pHash lies at or below this Hamming distance (of 64 bits) from an image"
        " already kept for its reference is rejected. Distances up to ~6 are the same picture re-encoded,"
        " slightly shifted or recoloured; different poses of one character lie well above 10. -1 never"
        " rejects (scores only).",
    )


class IdentityGapCheck(_Check):
    """The model's own identity check: the render's denoising loss with a different reference minus with
    its own (snapref_ray/evaluation.py's loss), averaged over a few fixed noise levels and noise seeds."""

    sigmas: list[float] = Field(
        [0.3, 0.6, 0.9],
        min_length=1,
        description="Noise levels in (0, 1]. Three spread over the schedule: 2 references x 3 sigmas x 1"
        " seed = 6 DiT row-forwards, a tenth of a 30-step CFG render's 60.",
    )
    noise_seeds: list[int] = Field(
        [0],
        min_length=1,
        description="Noise seeds, each shared by every sigma and both references (paired: the noise cancels"
        " in the difference). More seeds cost forwards in proportion and shrink the score's noise.",
    )
    min_gap: float = Field(
        0.0,
        description="An image whose gap (loss with the other reference minus loss with its own) is at or"
        " below this is rejected. 0: its own reference must explain it better than another does.",
    )
    contrast_reference: str | None = Field(
        None,
        description="The different reference: a path or URI of an image of another character (Ray Data"
        " resolves it against references_base; the endpoint takes a reference_id). A batch job picks"
        " another reference of the job itself.",
    )

    @model_validator(mode="after")
    def _sigmas_in_range(self) -> IdentityGapCheck:
        bad = [s for s in self.sigmas if not 0.0 < s <= 1.0]
        if bad:
            raise ValueError(f"sigmas must lie in (0, 1], got {bad}")
        return self


class EmbeddingCheck(_Check):
    """Identity by an image-embedding model on disk: cosine similarity of the render to its reference."""

    model: str = Field(
        ...,
        description="A local folder with a `transformers` image model saved by `save_pretrained` (DINOv2,"
        " CLIP or SigLIP: config, weights, preprocessor_config.json), or, with kind ccip, the name of an"
        " `imgutils` CCIP model already in the Hugging Face cache. Never downloaded.",
    )
    kind: Literal["transformers", "ccip"] = Field(
        "transformers",
        description="transformers: AutoModel + AutoImageProcessor from `model` (local_files_only). ccip: the"
        " anime character-identity model of `dghs-imgutils` (an optional install), score 1 - its difference.",
    )
    min_similarity: float = Field(
        0.5,
        ge=-1.0,
        le=1.0,
        description="An image less similar to its reference than this is rejected. Each family has its own"
        " scale (CLIP image-image similarities of one character sit higher than DINOv2's): 0.5 is a start"
        " to replace with a pilot run's histogram.",
    )


class JudgeSpec(BaseModel):
    """The checks a render is judged by (absent: not run; `{}`: the documented defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sanity: SanityCheck | None = Field(None, description="Non-finite latents, flat, black or clipped images.")
    near_duplicate: NearDuplicateCheck | None = Field(
        None, description="pHash Hamming distance to the nearest image already kept for the same reference."
    )
    identity_gap: IdentityGapCheck | None = Field(
        None, description="The model's own identity gap of the render (needs a reference and a contrast one)."
    )
    embedding: EmbeddingCheck | None = Field(
        None, description="Similarity of render and reference by an image-embedding model from a local folder."
    )

    @property
    def checks(self) -> tuple[CheckName, ...]:
        """The checks this spec runs, in the one order every door reports them."""
        return tuple(name for name in CHECKS if getattr(self, name) is not None)

    @classmethod
    def of_names(cls, names: str) -> JudgeSpec:
        """`sanity,near_duplicate` -> those checks with their defaults (the command line's short form)."""
        wanted = [name.strip() for name in names.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in CHECKS]
        if unknown:
            raise ValueError(f"unknown check {unknown[0]!r}; the checks are {', '.join(CHECKS)}")
        return cls.model_validate(dict.fromkeys(wanted, {}))
