"""The timing table's rows: a catalogue, as data, of the settings it compares, and which of them can run.

Each row is a name, a label and how its settings differ from the case's base settings. Values taken from
the timing spec are written `Spec("field")`, and labels are templates over the same fields, so the whole
table reads in one place and adding a row is adding a line. `timing_plan` turns the catalogue into the
settings of one spec, leaving out (with the reason) the rows the loaded adapters cannot render.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snapref_ray.requests import RenderSettings, StepCache

if TYPE_CHECKING:
    from snapref_ray.jobs.timing_spec import TimingSpec


@dataclass(frozen=True)
class Spec:
    """A value the timing spec gives (`Spec("ref_end")` is the spec's `ref_end`)."""

    field: str


@dataclass(frozen=True)
class Row:
    """One row of the catalogue: its settings are the base settings updated by `update`."""

    name: str
    label: str  # a template over the spec's fields, and `turbo_label`
    update: dict[str, Any] = field(default_factory=dict)
    reference: bool = True  # whether the row renders with the case's reference
    adapter_kind: str | None = None  # an ArcAnima row: which extra adapter renders it
    turbo: bool = False  # the turbo LoRA is merged for it (when the spec gives one)


_GUIDED = {"ref_guidance": Spec("ref_guidance"), "correction": "apg"}

CATALOGUE: tuple[Row, ...] = (
    Row("no_reference", "no reference (plain Anima)", reference=False),
    Row("snapref_default", "SnapRef default (cond row reads the cached reference)"),
    Row("ref_in_uncond", "ref_in_uncond (both CFG rows read it)", {"ref_in_uncond": True}),
    Row("ref_guidance_apg", "ref_guidance {ref_guidance:g} + APG (third row)", _GUIDED),
    Row(
        "ref_end_0.6",
        "ref_guidance {ref_guidance:g} + APG, ref_end {ref_end:g}",
        {**_GUIDED, "ref_end": Spec("ref_end")},
    ),
    Row(
        "recompute_every_step",
        "recompute the reference every step (pilot-style baseline)",
        {"recompute_reference_every_step": True},
    ),
    Row("turbo", "{turbo_label}", {"steps": Spec("turbo_steps"), "cfg": 1.0}, turbo=True),
    Row(
        "step_cache",
        "SnapRef default + step cache at ComfyUI's EasyCache defaults (threshold 0.2, 0.15-0.95), per image",
        {"step_cache": StepCache()},
    ),
    # ArcAnima at its own defaults (ref_guidance 4.5 + APG, both CFG rows read), and at ref_guidance 1
    # (no extra call), the setting of the published per-step GPU times.
    Row(
        "arcanima_v2",
        "ArcAnima v2 at its defaults (ref_guidance 4.5 + APG, both CFG rows read the cached reference)",
        adapter_kind="arcanima-v2",
    ),
    Row(
        "arcanima_v2_rg1",
        "ArcAnima v2, ref_guidance 1 (no extra call)",
        {"ref_guidance": 1.0},
        adapter_kind="arcanima-v2",
    ),
    Row(
        "arcanima_pilot",
        "ArcAnima pilot at its defaults (reference as a second frame, recomputed every step; ref_guidance 4.5 + APG)",
        adapter_kind="arcanima-pilot",
    ),
    Row(
        "arcanima_pilot_rg1",
        "ArcAnima pilot, ref_guidance 1 (no extra call)",
        {"ref_guidance": 1.0},
        adapter_kind="arcanima-pilot",
    ),
)
SETTING_NAMES: tuple[str, ...] = tuple(row.name for row in CATALOGUE)
ARCANIMA_ROWS: dict[str, str] = {row.name: row.adapter_kind for row in CATALOGUE if row.adapter_kind is not None}


@dataclass(frozen=True)
class TimingSetting:
    """A row of one spec's table: its label and settings filled in."""

    name: str
    label: str
    settings: RenderSettings
    reference: bool
    turbo: bool = False
    adapter_kind: str | None = None  # an ArcAnima row: which extra adapter renders it


def timing_settings(spec: TimingSpec, adapter_kind: str | None = "snapref") -> list[TimingSetting]:
    """The settings of the table that can run, in table order (no_reference first); see `timing_plan`."""
    return timing_plan(spec, adapter_kind)[0]


def timing_plan(spec: TimingSpec, adapter_kind: str | None = "snapref") -> tuple[list[TimingSetting], dict[str, str]]:
    """(the settings of the table that can run, in table order; the asked-for ones left out -> why).

    `adapter_kind` is the kind of `model.adapter` (or the models folder's adapter): SnapRef rows need a
    SnapRef file, an ArcAnima row the file of its kind (given as arcanima_*_adapter, found in the models
    folder, or the model's own adapter when it is of that kind).
    """
    available = spec.arcanima_adapters(adapter_kind)
    wanted = set(spec.settings) | {"no_reference"}
    chosen, left_out = [], {}
    for row in CATALOGUE:
        if row.name not in wanted:
            continue
        if row.adapter_kind is not None and row.adapter_kind not in available:
            left_out[row.name] = (
                f"needs an {row.adapter_kind} file (arcanima_{row.adapter_kind[9:]}_adapter, or"
                f" {row.adapter_kind}.safetensors in the models folder)"
            )
        elif row.adapter_kind is None and row.reference and adapter_kind != "snapref":
            left_out[row.name] = (
                "a SnapRef row: the model has no reference adapter"
                if adapter_kind is None
                else f"a SnapRef row: the model's adapter is an {adapter_kind} file"
            )
        else:
            chosen.append(_setting(row, spec))
    return chosen, left_out


def _setting(row: Row, spec: TimingSpec) -> TimingSetting:
    base = RenderSettings(
        negative_prompt=spec.negative_prompt,
        width=spec.width,
        height=spec.height,
        steps=spec.steps,
        cfg=spec.cfg,
        sampler=spec.sampler,
    )
    update = {k: getattr(spec, v.field) if isinstance(v, Spec) else v for k, v in row.update.items()}
    # Validated whole: model_copy(update=...) would not run the validators.
    settings = RenderSettings(**{**base.model_dump(), **update})
    label = row.label.format(**spec.model_dump(), turbo_label=_turbo_label(spec))
    turbo = row.turbo and spec.turbo_lora is not None
    return TimingSetting(row.name, label, settings, row.reference, turbo=turbo, adapter_kind=row.adapter_kind)


def _turbo_label(spec: TimingSpec) -> str:
    if spec.turbo_lora is not None:
        return (
            f"turbo: LoRA {Path(spec.turbo_lora.path).name} x{spec.turbo_lora.strength:g} merged, "
            f"{_steps(spec.turbo_steps)}, cfg 1"
        )
    return f"turbo settings ({_steps(spec.turbo_steps)}, cfg 1) on the base model: no turbo LoRA given"


def _steps(n: int) -> str:
    return f"{n} step" + ("" if n == 1 else "s")
