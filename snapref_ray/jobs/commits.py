"""How the driver commits what the workers publish: the one seam between the schedule and the output.

The schedule hands the driver each returned image's row and each staged webdataset shard; a `Commits` decides how
they enter the output (always through its `JobOutput`, under the lease) and what the schedule renders next because
of them. The driver is handed one and does not ask which (jobs/generate_dataset.py `_render`):

- `PlainCommits` (this module): a row is committed as it lands (a webdataset row rides in with its shard, when
  the shard is committed); nothing more is rendered.
- `JudgedCommits` (jobs/judged_commit.py): the driver's verdict on each render goes into its row before the commit;
  a rejected render's next render joins the running schedule, what an earlier run left to render again is a round
  of its own after it, and a reference at its quota has its queued items skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from snapref_ray.cluster.placement import PlannedWork
from snapref_ray.cluster.tasks import ItemOutcome
from snapref_ray.jobs.spilled_items import SpilledItems
from snapref_ray.render_service.work_items import WorkItem
from snapref_ray.storage.job_output import JobOutput


@dataclass(frozen=True)
class CommitFigures:
    """What a job's commits add to its summary.json."""

    items_rendered: int  # items whose image this run committed (a judged item counts once, at its first render)
    skipped_by_quota: int | None = None  # the job's items a met quota left unrendered (None: no quota, or not read)
    skipped_not_rendered: int = 0  # of them, items never rendered at all
    judge: dict | None = None  # a judged job's `judge` block


class Commits(Protocol):
    """What the driver asks of a job's commits (see the module docstring)."""

    adds_work: bool  # renders may join the running schedule (the scheduler must not end when its queue is empty)
    skip_reference: Callable[[str], bool] | None  # a reference whose queued items are skipped (a met quota)

    def has_earlier_work(self) -> bool:
        """Whether earlier runs left renders to make (a job with nothing left to render may still have some)."""
        ...

    def commit_row(self, outcome: ItemOutcome) -> None:
        """Commit a returned image's row (a webdataset row is committed with its shard)."""
        ...

    def commit_shard(self, shard_key: str) -> bool:
        """Commit a staged shard; False: it was voided and its items render again."""
        ...

    def next_render(self, item: WorkItem) -> WorkItem | None:
        """What `item`, just committed, asks to render next in the running schedule."""
        ...

    def next_round(self, plan: SpilledItems) -> PlannedWork | None:
        """The schedule ended: what to render in one more run of it on the same pool (None: the job is done)."""
        ...

    def schedule_ended(self, skipped_items: int) -> None:
        """Every round ran; `skipped_items`: the queued items the schedule skipped (`skip_reference`)."""
        ...

    def figures(self, plan: SpilledItems, images_this_run: int, *, interrupted: bool) -> CommitFigures:
        """The summary's part of the commits, at the end of the run (under the lease)."""
        ...


class PlainCommits:
    """A job that does not judge: every returned row is committed as it is."""

    adds_work = False
    skip_reference = None

    def __init__(self, output: JobOutput) -> None:
        self.output = output

    def has_earlier_work(self) -> bool:
        return False

    def commit_row(self, outcome: ItemOutcome) -> None:
        if outcome.row.get("shard_key"):
            return  # its rows went into metadata/ with its shard, when the shard was committed (commit_shard)
        self.output.commit_row(outcome.row)

    def commit_shard(self, shard_key: str) -> bool:
        return self.output.commit_shard(shard_key)

    def next_render(self, item: WorkItem) -> WorkItem | None:
        return None

    def next_round(self, plan: SpilledItems) -> PlannedWork | None:
        return None

    def schedule_ended(self, skipped_items: int) -> None:
        pass

    def figures(self, plan: SpilledItems, images_this_run: int, *, interrupted: bool) -> CommitFigures:
        return CommitFigures(items_rendered=images_this_run)


__all__ = ["CommitFigures", "Commits", "PlainCommits"]
