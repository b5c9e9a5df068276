"""Per-kind defaults, which settings apply to which adapter kind, and the simple controls' mapping.

`resolve_settings(settings, kind)` turns what the user asked for into the concrete settings a
render runs with. A field the user set always wins; an unset (None) field takes the kind's
default as its authors publish it; a field that does not apply to the loaded kind is rejected,
naming the field and the kind, never silently ignored. Each kind's defaults and misfits are in
its row of `kinds.KINDS`.

| control | SnapRef | ArcAnima v2 / pilot |
|---|---|---|
| `strength` | sets `ref_weight` (reference attention mass) | the LoRA multiplier in reading rows (default 1) |
| `fidelity` | sets `ref_guidance` | sets `ref_guidance` |
| `ref_guidance` default | 1 (off; only the cond row reads) | 4.5 with APG (both CFG rows read) |
| `ref_in_uncond` default | off | on |
"""

from __future__ import annotations

from snapref_ray.adapter.kinds import KINDS
from snapref_ray.input_errors import InputError
from snapref_ray.requests import RenderSettings

SNAPREF = "snapref"  # the kind whose defaults a render without an adapter takes


class SettingsError(InputError):
    """A setting that does not fit the loaded adapter kind; `field` names it, `reason` says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}", reason=message, field=field)


def resolve_settings(settings: RenderSettings, kind: str | None) -> RenderSettings:
    """Concrete settings for `kind` ("snapref", "arcanima-v2", "arcanima-pilot"; None = no adapter).

    The result has ref_guidance, ref_in_uncond, ref_outside and strength filled in; for SnapRef
    strength equals ref_weight. Idempotent: resolving resolved settings changes nothing.
    """
    kind = kind or SNAPREF
    if kind not in KINDS:
        raise ValueError(f"unknown adapter kind {kind!r}")
    row = KINDS[kind]
    fields = RenderSettings.model_fields
    for name, why in row.not_applicable.items():
        value = getattr(settings, name)
        # The field's default and the kind's own behaviour (what a resolved copy holds) are no misfit.
        if value not in (fields[name].default, row.settings_defaults.get(name, fields[name].default)):
            raise SettingsError(name, f"{name}={value!r} does not apply to {kind} adapters ({why})")
    update: dict[str, object] = {}
    if settings.fidelity is not None:
        if settings.ref_guidance is not None and settings.ref_guidance != settings.fidelity:
            raise SettingsError(
                "fidelity",
                f"fidelity={settings.fidelity:g} and ref_guidance="
                f"{settings.ref_guidance:g} disagree; fidelity sets ref_guidance, give one",
            )
        update["ref_guidance"] = settings.fidelity
    if row.strength_sets == "ref_weight":
        if settings.strength is not None:
            if settings.ref_weight != fields["ref_weight"].default and settings.ref_weight != settings.strength:
                raise SettingsError(
                    "strength",
                    f"strength={settings.strength:g} and ref_weight="
                    f"{settings.ref_weight:g} disagree; for {kind} adapters strength sets ref_weight, give one",
                )
            update["ref_weight"] = settings.strength
        update["strength"] = update.get("ref_weight", settings.ref_weight)
    elif settings.strength is None:
        update["strength"] = 1.0
    for name, default in row.settings_defaults.items():
        if getattr(settings, name) is None and name not in update:
            update[name] = default
    if not update:
        return settings
    return RenderSettings(**{**settings.model_dump(), **update})
