"""The one request model: what a render is asked to do.

Job specs (and their manifest rows), the command line and the HTTP API all map onto
`RenderSettings`, so a parameter means the same thing everywhere. Field descriptions say why a
default is what it is.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from snapref_ray.geometry import PIXELS_PER_TOKEN
from snapref_ray.input_errors import InputError
from snapref_ray.validation import field_error

Sampler = Literal["euler", "er_sde"]
Scheduler = Literal["simple"]
Correction = Literal["apg", "rescale", "none"]
Mode = Literal["cs", "char"]
Outside = Literal["reference", "no_reference"]

MIN_SIDE, MAX_SIDE = 256, 4096


class StepCache(BaseModel):
    """ComfyUI's EasyCache rule, decided for each image of a batch (snapref_ray/sampling/step_cache.py).

    An image skips a DiT forward, reusing its last output deltas, while the accumulated estimated relative
    change of its model output stays below `threshold`, inside [start, end] of the schedule. The defaults are
    ComfyUI's EasyCache node's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    threshold: float = Field(
        0.2, ge=0.0, le=3.0, description="Reuse threshold on the accumulated relative output change; 0 never skips."
    )
    start: float = Field(0.15, ge=0.0, le=1.0, description="Fraction of the schedule where skipping may start.")
    end: float = Field(0.95, ge=0.0, le=1.0, description="Fraction of the schedule where skipping stops.")

    @model_validator(mode="after")
    def _window(self) -> StepCache:
        if self.start > self.end:
            raise field_error("start", f"step_cache start ({self.start}) must not exceed its end ({self.end})")
        return self


class RenderSettings(BaseModel):
    """Everything about one render except the prompt text, the seed and the reference itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    negative_prompt: str = Field("", description="Negative prompt; empty is the ComfyUI default for Anima.")
    width: int = Field(
        1024, description="Image width in pixels, a multiple of 16 (the VAE's 8 times the DiT's patch 2)."
    )
    height: int = Field(1024, description="Image height in pixels, a multiple of 16.")
    steps: int = Field(30, ge=1, le=1000, description="Sampling steps; Anima's card recommends 28-50.")
    cfg: float = Field(
        4.5,
        ge=0.0,
        le=100.0,
        description="Text CFG scale; 4.5 as both adapters' authors recommend (Anima's card: 4-5). 1 skips "
        "the uncond pass.",
    )
    sampler: Sampler = Field("er_sde", description="er_sde is Anima's recommended sampler; euler is deterministic.")
    scheduler: Scheduler = Field("simple", description="ComfyUI's `simple` schedule over the shift-3 flow sigmas.")
    denoise: float = Field(
        1.0, gt=0.0, le=1.0, description="1 = text-to-image; < 1 starts from an input image (img2img)."
    )
    cfg_correction: Correction = Field(
        "none",
        description="Correction of the text CFG delta: none (plain ComfyUI CFG), apg or rescale (RescaleCFG 0.7).",
    )

    mode: Mode = Field(
        "cs", description="cs copies character and style; char copies only the character so artist tags set the style."
    )
    ref_weight: float = Field(
        1.0,
        ge=0.0,
        le=10.0,
        description="Multiplier on the reference's attention mass; 1 as trained, 0 bypasses the read.",
    )
    ref_guidance: float | None = Field(
        None,
        ge=0.0,
        le=20.0,
        description="Extra guidance towards the reference; != 1 runs a third row (positive prompt without reference). "
        "Unset = the adapter kind's default: 1 (off) for SnapRef, 4.5 for ArcAnima.",
    )
    ref_in_uncond: bool | None = Field(
        None,
        description="Let the uncond CFG row read the reference too. Unset = the kind's default: off for SnapRef "
        "(as trained), on for ArcAnima (both CFG branches read it).",
    )
    correction: Correction = Field(
        "apg", description="Correction of the reference-guidance delta, against colour over-saturation."
    )
    ref_start: float = Field(
        0.0, ge=0.0, le=1.0, description="Fraction of the schedule where reference guidance starts."
    )
    ref_end: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Fraction of the schedule where reference guidance stops; ~0.6 saves time with nearly "
        "the same image.",
    )
    ref_caption: str = Field(
        "", description="Caption of the reference image for its own cross-attention; empty is allowed."
    )
    ref_megapixels: float = Field(
        1.0, gt=0.0, le=16.0, description="Reference resized to at most this area, never enlarged; 1 MP as trained."
    )
    recompute_reference_every_step: bool = Field(
        False,
        description="Run the reference stream again at every step instead of the cache: the baseline the "
        "cache is measured against.",
    )
    ref_outside: Outside | None = Field(
        None,
        description="ArcAnima guider's `outside`: what applies outside [ref_start, ref_end]. reference (default): "
        "rows keep reading the reference, only the extra ref-guidance call stops; no_reference: "
        "those steps render without the reference (and without its LoRA).",
    )
    strength: float | None = Field(
        None,
        ge=0.0,
        le=10.0,
        description="Simple control. SnapRef: sets ref_weight. ArcAnima: the LoRA multiplier in reading "
        "rows (default 1).",
    )
    fidelity: float | None = Field(
        None, ge=0.0, le=20.0, description="Simple control: sets ref_guidance (for every kind)."
    )
    step_cache: StepCache | None = Field(
        None,
        description="Skip DiT forwards whose output barely changes, per image (ComfyUI's EasyCache rule); off by"
        " default because it trades some fidelity for speed. `true` (or `on`) = ComfyUI's defaults; a number ="
        " that threshold; or {threshold, start, end}.",
    )

    @field_validator("step_cache", mode="before")
    @classmethod
    def _step_cache_shorthands(cls, v: Any) -> Any:
        # A manifest cell or a flag is text: "on", "0.3" or a JSON object all mean what they say.
        if isinstance(v, str):
            text = v.strip().lower()
            if text in ("", "off", "false", "none", "no"):
                return None
            if text in ("on", "true", "yes"):
                return {}
            try:
                return {"threshold": float(text)}
            except ValueError:
                try:
                    return json.loads(v)
                except json.JSONDecodeError:
                    raise ValueError(f"step_cache: expected on/off, a threshold or a JSON object, got {v!r}") from None
        if v is True:
            return {}
        if v is False:
            return None
        if isinstance(v, (int, float)):
            return {"threshold": float(v)}
        return v

    @field_validator("width", "height")
    @classmethod
    def _side(cls, v: int, info) -> int:
        if v % PIXELS_PER_TOKEN or not MIN_SIDE <= v <= MAX_SIDE:
            # A server validates with its own cap in the context ("max_side"): the message states the bound it
            # enforces, not the model's (it checks a side between the two against its limits itself).
            top = min(MAX_SIDE, (info.context or {}).get("max_side", MAX_SIDE))
            raise ValueError(
                f"{info.field_name} must be a multiple of {PIXELS_PER_TOKEN} between {MIN_SIDE} and {top}, got {v}"
            )
        return v

    @model_validator(mode="after")
    def _window(self) -> RenderSettings:
        if self.ref_start > self.ref_end:
            raise field_error("ref_start", f"ref_start ({self.ref_start}) must not exceed ref_end ({self.ref_end})")
        return self

    def batch_key(self) -> tuple:
        """Settings that must agree for requests to share one batched forward.

        Everything but the prompts (positive and negative) and the seed: the schedule, guidance
        rows and the reference read (its caption included) are per batch.
        """
        dump = self.model_dump(exclude={"negative_prompt"})
        return tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in dump.items()))


class RenderRequest(BaseModel):
    """One image (or `n` with consecutive seeds): prompt + seed + settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: str = Field(..., description="The scene prompt (Anima is tag-prompted); the reference says who is drawn.")
    seed: int = Field(0, ge=0, lt=2**63, description="Noise seed; ComfyUI-compatible for a single image.")
    settings: RenderSettings = Field(default_factory=RenderSettings)


class RowDefaults(RenderSettings):
    """Defaults for every manifest or Ray Data row: every `RenderSettings` field, plus seed and images_per_prompt.

    Derived from the request model (not a copy of its fields) so a new render setting is a valid
    default and row column at once. A row's own value beats the default.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(
        0,
        ge=0,
        lt=2**63,
        description="Seed of a row's first image; image k uses seed + k. 0 so that a job renders the same images"
        " on every run.",
    )
    images_per_prompt: int = Field(
        1,
        ge=1,
        le=10_000,
        description="Images per row (consecutive seeds); 1 because a dataset usually wants one per prompt.",
    )

    def settings(self) -> RenderSettings:
        """The `RenderSettings` part (without seed and images_per_prompt)."""
        return RenderSettings(**self.model_dump(exclude=set(ROW_ONLY_DEFAULTS)))


ROW_ONLY_DEFAULTS = ("seed", "images_per_prompt")


class RenderError(InputError):
    """A render request that cannot be carried out; the message names the field, `field` too when known,
    and `reason` is the message without the field's name where the raiser gave it apart.

    Raised by the engine and by the adapter kinds it runs (snapref_ray.engine re-exports it).
    """

    def __init__(self, message: str, field: str | None = None, *, reason: str | None = None) -> None:
        super().__init__(message, reason=reason, field=field)
