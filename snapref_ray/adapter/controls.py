"""Per-kind defaults, which settings apply to which adapter kind, and the simple controls' mapping.

`resolve_settings(settings, kind)` turns what the user asked for into the concrete settings a
render runs with. A field the user set always wins; an unset (None) field takes the kind's
default as its authors publish it; a field that does not apply to the loaded kind is rejected,
naming the field and the kind, never silently ignored.

| control | SnapRef | ArcAnima v2 / pilot |
|---|---|---|
| `strength` | sets `ref_weight` (reference attention mass) | the LoRA multiplier in reading rows (default 1) |
| `fidelity` | sets `ref_guidance` | sets `ref_guidance` |
| `ref_guidance` default | 1 (off; only the cond row reads) | 4.5 with APG (both CFG rows read) |
| `ref_in_uncond` default | off | on |
"""

from __future__ import annotations

from snapref_ray.requests import RenderSettings

SNAPREF = "snapref"
ARCANIMA = ("arcanima-v2", "arcanima-pilot")

# Defaults the authors publish for each kind; applied only where the user left the field unset.
KIND_DEFAULTS: dict[str, dict[str, object]] = {
    SNAPREF: {"ref_guidance": 1.0, "ref_in_uncond": False, "ref_outside": "reference"},
    "arcanima-v2": {"ref_guidance": 4.5, "ref_in_uncond": True, "ref_outside": "reference"},
    "arcanima-pilot": {"ref_guidance": 4.5, "ref_in_uncond": True, "ref_outside": "reference"},
}
# Fields that mean nothing for a kind -> why (the error message's tail).
NOT_APPLICABLE: dict[str, dict[str, str]] = {
    SNAPREF: {
        "ref_outside": "it is the ArcAnima guider's option; SnapRef skips only the extra call outside the window"
    },
    "arcanima-v2": {
        "mode": "modes are per-block read weights of SnapRef files",
        "ref_weight": "ArcAnima has no reference attention weight; use strength (the LoRA multiplier)",
        "ref_caption": "the v2 reference stream skips text cross-attention",
        "recompute_reference_every_step": "it is SnapRef's uncached baseline",
    },
    "arcanima-pilot": {
        "mode": "modes are per-block read weights of SnapRef files",
        "ref_weight": "ArcAnima has no reference attention weight; use strength (the LoRA multiplier)",
        "ref_caption": "the pilot's reference frame has no caption of its own",
        "recompute_reference_every_step": "the pilot recomputes its reference frame at every step anyway",
        "ref_megapixels": "the pilot's reference is resized to the output size",
    },
}


class SettingsError(ValueError):
    """A setting that does not fit the loaded adapter kind; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def resolve_settings(settings: RenderSettings, kind: str | None) -> RenderSettings:
    """Concrete settings for `kind` ("snapref", "arcanima-v2", "arcanima-pilot"; None = no adapter).

    The result has ref_guidance, ref_in_uncond, ref_outside and strength filled in; for SnapRef
    strength equals ref_weight. Idempotent: resolving resolved settings changes nothing.
    """
    kind = kind or SNAPREF
    if kind not in KIND_DEFAULTS:
        raise ValueError(f"unknown adapter kind {kind!r}")
    fields = RenderSettings.model_fields
    for name, why in NOT_APPLICABLE[kind].items():
        value = getattr(settings, name)
        # The field's default and the kind's own behaviour (what a resolved copy holds) are no misfit.
        if value not in (fields[name].default, KIND_DEFAULTS[kind].get(name, fields[name].default)):
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
    if kind == SNAPREF:
        if settings.strength is not None:
            if settings.ref_weight != fields["ref_weight"].default and settings.ref_weight != settings.strength:
                raise SettingsError(
                    "strength",
                    f"strength={settings.strength:g} and ref_weight="
                    f"{settings.ref_weight:g} disagree; for SnapRef strength sets"
                    " ref_weight, give one",
                )
            update["ref_weight"] = settings.strength
        update["strength"] = update.get("ref_weight", settings.ref_weight)
    elif settings.strength is None:
        update["strength"] = 1.0
    for name, default in KIND_DEFAULTS[kind].items():
        if getattr(settings, name) is None and name not in update:
            update[name] = default
    if not update:
        return settings
    return RenderSettings(**{**settings.model_dump(), **update})
