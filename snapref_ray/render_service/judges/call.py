"""What a render is judged by, as a door asks it: the `JudgeSpec` and the inputs only the caller has, checked
before any device work. Plain values without torch: the batch driver builds them (registry.py runs them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from snapref_ray.render_service.judges.spec import JudgeSpec
from snapref_ray.render_service.references import Reference, check_reference
from snapref_ray.requests import RenderError, RenderSettings


@dataclass(frozen=True)
class JudgeCall:
    """What a render is judged by: the checks and the inputs only its caller has.

    `kept_phashes`: the pHashes (64-bit unsigned) of the images already kept for the render's reference
    (near_duplicate scores the distance to the nearest). `contrast`: a reference of another character
    (identity_gap; its key is re-made for each render's settings by the service).
    """

    spec: JudgeSpec
    kept_phashes: tuple[int, ...] = ()
    contrast: Reference | None = None


def judge_call(spec: JudgeSpec | None, read: Callable[[str], bytes]) -> JudgeCall | None:
    """The `JudgeCall` a door makes of a spec (None for none): its contrast reference, a path or URI, read
    with `read` and checked now, before any device work."""
    if spec is None:
        return None
    gap = spec.identity_gap
    if gap is None or gap.contrast_reference is None:
        return JudgeCall(spec)
    source = gap.contrast_reference
    try:
        data = read(source)
        check_reference([data], "single", [source], None)
    except Exception as e:  # unreadable or not an image: the field is at fault, whatever the reason
        raise RenderError(
            f"judge.identity_gap.contrast_reference {source}: {e}", field="judge.identity_gap.contrast_reference"
        ) from None
    # Keyed for default settings here; the service re-keys it for each render's size and caption.
    return JudgeCall(spec, contrast=Reference.of_images([data], "single", RenderSettings(), [source]))


def check_call(call: JudgeCall, has_reference: bool) -> None:
    """Refuse, before any device work, a call whose checks cannot run (RenderError naming the field)."""
    spec = call.spec
    if spec.identity_gap is not None:
        if not has_reference:
            raise RenderError("judge.identity_gap needs a render with a reference", field="judge.identity_gap")
        if call.contrast is None:
            raise RenderError(
                "judge.identity_gap needs a contrast reference (another character): set"
                " judge.identity_gap.contrast_reference",
                field="judge.identity_gap.contrast_reference",
            )
    if spec.embedding is not None and not has_reference:
        raise RenderError("judge.embedding compares a render with its reference; this one has none", "judge.embedding")
