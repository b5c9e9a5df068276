"""The timing table's catalogue of rows, as data: the settings it compares, each as a name, a label and how its
settings differ from the case's base settings.

Values taken from the timing spec are written `Spec("field")`, and labels are templates over the same fields,
so the whole table reads in one place and adding a row is adding a line. timing_settings.py fills the rows in
for one spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from snapref_ray.requests import StepCache


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
