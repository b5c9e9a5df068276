"""What the judges say about one render: `Judgement`, its typed scores and per-check verdicts.

Every score a requested check computes is recorded whatever the verdict (a threshold is picked later
from their histograms: docs/judging.md). The same `Judgement` reaches every door: a Ray Data row's
`score_<name>` / `phash` / `accepted` columns (`judgement_columns`), the endpoint's JSON answer, the
PNG's `snapref` chunk and `txt2img`'s printed line. Torch-free.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from snapref_ray.render_service.judges.spec import CHECKS, CheckName


class JudgeScores(BaseModel):
    """One render's scores; None where the check was not asked for."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sanity_nonfinite: float | None = Field(None, description="Fraction of the final latent's elements not finite.")
    sanity_std: float | None = Field(None, description="Std (0-255) of the most varied RGB channel.")
    sanity_luminance: float | None = Field(None, description="Mean Rec. 601 luminance, 0-255.")
    sanity_clipped: float | None = Field(None, description="Fraction of channel values at 0 or 255.")
    near_duplicate: int | None = Field(
        None, description="Hamming distance of the pHash to the nearest given kept hash; 64 when none was given."
    )
    phash: str | None = Field(
        None, description="The image's 64-bit pHash as 16 hex digits (what a kept set holds, 8 bytes each)."
    )
    identity_gap: float | None = Field(
        None, description="Mean denoising loss with the contrast reference minus with its own (higher: more its own)."
    )
    embedding: float | None = Field(None, description="Cosine similarity of render and reference embeddings.")


class JudgeVerdicts(BaseModel):
    """Per check: True when the render passed it, None when the check was not asked for."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sanity: bool | None = None
    near_duplicate: bool | None = None
    identity_gap: bool | None = None
    embedding: bool | None = None


class Judgement(BaseModel):
    """One render's scores and verdicts; `accepted` when it passed every check it was judged by."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scores: JudgeScores
    verdicts: JudgeVerdicts
    accepted: bool = Field(..., description="Passed every check asked for (True when none was).")

    @classmethod
    def of(cls, scores: JudgeScores, verdicts: dict[CheckName, bool]) -> Judgement:
        return cls(scores=scores, verdicts=JudgeVerdicts(**verdicts), accepted=all(verdicts.values()))

    @property
    def rejected_by(self) -> tuple[CheckName, ...]:
        """The checks it failed, in the one check order."""
        return tuple(name for name in CHECKS if getattr(self.verdicts, name) is False)


# Columns a door adds to a row for a judged render: one per score (`score_<name>`), the hash, the verdict.
SCORE_NAMES: tuple[str, ...] = tuple(name for name in JudgeScores.model_fields if name != "phash")
JUDGEMENT_COLUMNS: tuple[str, ...] = (*(f"score_{name}" for name in SCORE_NAMES), "phash", "accepted")


def judgement_columns(judgement: Judgement | None) -> dict[str, Any]:
    """A row's judge columns (`JUDGEMENT_COLUMNS`) for `judgement`; all null without one (a failed row)."""
    if judgement is None:
        return dict.fromkeys(JUDGEMENT_COLUMNS)
    scores = judgement.scores
    return {
        **{f"score_{name}": getattr(scores, name) for name in SCORE_NAMES},
        "phash": scores.phash,
        "accepted": judgement.accepted,
    }
