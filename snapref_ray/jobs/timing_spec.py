"""The timing table's spec: one case (size, steps, sampler, prompt, seed, reference) and the settings to compare.

The rows it may name are the catalogue's (timing_catalogue.py); the job that measures them is timing_table.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, field_validator

from snapref_ray.job_spec import ClusterSpec, OutputSpec, SpecFile, load_spec_file
from snapref_ray.jobs.timing_catalogue import SETTING_NAMES
from snapref_ray.model_spec import LoRASpec, ModelSpec
from snapref_ray.requests import Sampler
from snapref_ray.storage.backends import S3Options


class TimingSpec(SpecFile):
    """One timing case and the settings to compare on it."""

    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("arcanima_v2_adapter", "arcanima_pilot_adapter", "reference")

    model: ModelSpec = Field(
        ..., description="The model and the SnapRef adapter of the SnapRef rows (as in a batch job spec)."
    )
    arcanima_v2_adapter: str | None = Field(
        None,
        description="ArcAnima v2 file for the arcanima_v2 rows; None = arcanima-v2.safetensors in models_dir "
        "if there is one (else those rows are left out, and the table says so).",
    )
    arcanima_pilot_adapter: str | None = Field(
        None,
        description="ArcAnima pilot file for the arcanima_pilot rows; None = arcanima-pilot.safetensors in "
        "models_dir if there is one.",
    )
    reference: str | None = Field(
        None, description="Reference image; None = reference.png in models_dir (the tiny model set has one)."
    )
    prompt: str = Field(
        "1girl, solo, cowboy shot, sitting, cafe, holding cup, smile, looking at viewer, window, day",
        description="Scene prompt of the case; its content does not change the cost.",
    )
    negative_prompt: str = Field("", description="Negative prompt; empty as Anima's ComfyUI default.")
    width: int = Field(832, description="Image width; 832x1216 is the size of the published GPU step times.")
    height: int = Field(1216, description="Image height.")
    steps: int = Field(28, ge=1, le=1000, description="Steps; 28, the step count of the published comparison.")
    sampler: Sampler = Field("euler", description="euler: deterministic (no step noise) and one model call per step.")
    cfg: float = Field(4.5, ge=0.0, description="Text CFG; 4.5 as SnapRef recommends (so the uncond row runs).")
    seed: int = Field(0, ge=0, description="Noise seed; the same for every setting.")
    ref_guidance: float = Field(
        4.5,
        description="ref_guidance of the ref-guidance settings; 4.5 as the ArcAnima "
        "table uses (any value != 1 costs the same).",
    )
    ref_end: float = Field(
        0.6,
        ge=0.0,
        le=1.0,
        description="ref_end of the early-stop setting; ~0.6 is the suggested saving with nearly the same image.",
    )
    turbo_lora: LoRASpec | None = Field(
        None,
        description="Turbo LoRA merged for the turbo row; None = the turbo "
        "sampling settings on the base model (said in the table).",
    )
    turbo_steps: int = Field(10, ge=1, description="Steps of the turbo row; 10 as the ArcAnima turbo row.")
    settings: list[str] = Field(
        list(SETTING_NAMES),
        description="Which settings to run; no_reference is always run (the ratios are against it).",
    )
    repetitions: int = Field(
        3, ge=1, le=100, description="Interleaved repetitions per setting; the median of 3 rejects one outlier."
    )
    warmup: bool = Field(True, description="Run each setting once unmeasured first (allocator, kernel selection).")
    title: str | None = Field(None, description="Heading of the Markdown table; default says device and model.")
    output: OutputSpec = Field(default_factory=OutputSpec, description="Where comparison_summary.* go.")
    cluster: ClusterSpec = Field(
        default_factory=ClusterSpec,
        description="Ray address, device and dtype (one actor; num_cpus_per_worker applies).",
    )

    @field_validator("settings")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        unknown = [name for name in v if name not in SETTING_NAMES]
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(SETTING_NAMES)}")
        return v

    def s3_options(self) -> S3Options:
        return self.output.s3.options()

    def arcanima_adapters(self, model_adapter_kind: str | None = None) -> dict[str, str]:
        """kind -> local file of the ArcAnima rows that can run (given, found in models_dir, or the model's
        own adapter when it is of that kind)."""
        found = {}
        if model_adapter_kind in ("arcanima-v2", "arcanima-pilot") and self.model.adapter is not None:
            found[model_adapter_kind] = self.model.adapter
        for kind, given in (("arcanima-v2", self.arcanima_v2_adapter), ("arcanima-pilot", self.arcanima_pilot_adapter)):
            if given is not None:
                found[kind] = given
            elif (
                self.model.models_dir is not None
                and not self.model.models_dir.startswith("s3://")
                and (Path(self.model.models_dir) / f"{kind}.safetensors").is_file()
            ):
                found[kind] = str(Path(self.model.models_dir) / f"{kind}.safetensors")
        return found

    def reference_uri(self) -> str:
        if self.reference is not None:
            return self.reference
        if self.model.models_dir is None:
            raise ValueError("give `reference:` (no models_dir to take reference.png from)")
        return self.model.models_dir.rstrip("/") + "/reference.png"


def load_timing_spec(path_or_uri: str, s3: S3Options | None = None) -> TimingSpec:
    """Load a timing spec YAML; relative paths resolve against its folder."""
    return load_spec_file(path_or_uri, TimingSpec, s3, what="timing spec")
