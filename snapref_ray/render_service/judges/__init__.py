"""Judges: the checks a render can be scored by, on the worker right after its decode (docs/judging.md).

spec.py (`JudgeSpec`), call.py (`JudgeCall`, what a door asks a render to be judged by) and scores.py
(`Judgement`), all three torch-free; one module per check (sanity, near_duplicate, identity_gap, embedding) and
registry.py (`Judges`: how a render service runs them over a batch).
"""

from snapref_ray.lazy_exports import lazy_exports

_EXPORTS = {
    "CHECKS": "spec",
    "JudgeSpec": "spec",
    "Judgement": "scores",
    "JudgeScores": "scores",
    "JudgeVerdicts": "scores",
    "JUDGEMENT_COLUMNS": "scores",
    "judgement_columns": "scores",
    "JudgeCall": "call",
    "Judges": "registry",
    "nearest_distance": "near_duplicate",
    "parse_phash": "near_duplicate",
    "phash": "near_duplicate",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
