"""The timing table's rows for one spec: the catalogue (timing_catalogue.py) filled in, and which rows can run.

`settings_to_time` leaves out, with the reason, the rows the loaded adapters cannot render.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from snapref_ray.jobs.timing_catalogue import CATALOGUE, Row, Spec
from snapref_ray.jobs.timing_spec import TimingSpec
from snapref_ray.requests import RenderSettings


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
    """The settings of the table that can run, in table order (no_reference first); see `settings_to_time`."""
    return settings_to_time(spec, adapter_kind)[0]


def settings_to_time(
    spec: TimingSpec, adapter_kind: str | None = "snapref"
) -> tuple[list[TimingSetting], dict[str, str]]:
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
