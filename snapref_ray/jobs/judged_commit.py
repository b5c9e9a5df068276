"""A judged job's commits (the seam: jobs/commits.py): the driver's verdict put into each render's row, and, where
the spec does not keep rejected images (`judge.keep_rejected_images: false`), the rejected images taken out of what
readers see.

- ``files``: the row is decided and committed on its own; a rejected image's file and thumbnail are deleted and
  its row names none (`JudgedCommits.commit_row`).
- ``webdataset``: a worker staged the shard (tar, index, rows) before the verdicts existed. The driver decides
  them on the staged rows (small), in the order of the rows; if a rejected render's image must go, the shard's
  tar and index are rewritten without it by a Ray task (storage/shards.py `filter_staged_shard`: the driver never
  reads a tar, which can be 1 GB), the rows are rewritten with the verdicts, and only then is the shard's one
  conditional create made (`JudgedCommits.commit_shard`). A driver killed anywhere before that create leaves a
  shard nobody decided: the next run voids it and its items render again, so no kept image is lost or doubled.

The verdicts count (kept sets, quotas, re-renders: jobs/judge_loop.py `JudgeLoop.apply`) once the commit is
certain: a voided shard's renders never enter a kept set.
"""

from __future__ import annotations

import logging

import pyarrow as pa

from snapref_ray.cluster.placement import PlannedWork
from snapref_ray.cluster.tasks import ItemOutcome
from snapref_ray.job_spec import JudgeSection
from snapref_ray.jobs.commits import CommitFigures
from snapref_ray.jobs.judge_loop import Decision, JudgeLoop, decided_row
from snapref_ray.jobs.quota_skips import QuotaSkips, find_quota_skips, plan_item_tables, write_skipped
from snapref_ray.jobs.spilled_items import SpilledItems
from snapref_ray.render_service.work_items import WorkItem
from snapref_ray.storage.backends import Storage, StorageError
from snapref_ray.storage.job_output import JobOutput
from snapref_ray.storage.lease import LeaseLostError
from snapref_ray.storage.shards import (
    filter_staged_shard,
    read_staged_rows,
    replace_staged_rows,
    void_staged_shard,
)

log = logging.getLogger(__name__)

# The staged row columns a verdict reads.
_DECIDED_FROM = [
    "item_id",
    "render_of",
    "render_index",
    "reference_hash",
    "phash",
    "rejected_by",
    "sample_s",
    "decode_s",
    "forward_batch",
]

# What a row whose image was not kept names of it: nothing (its scores and verdict stay).
_IMAGE_COLUMNS = ("image_key", "image_uri", "thumb_key", "shard_key", "shard_member")


class JudgedCommits:
    """A judged job's commits (jobs/commits.py `Commits`): each render's verdict, decided by the driver's
    `JudgeLoop` in the order of the commits, put into its row (or its staged shard's rows) before the commit."""

    adds_work = True  # a rejected render's next render joins the running schedule

    def __init__(self, output: JobOutput, judge: JudgeLoop) -> None:
        self.output, self.judge = output, judge
        self.rounds = 0
        quota = judge.section.kept_per_reference is not None
        self.skip_reference = judge.at_quota if quota else None

    @classmethod
    def resume(cls, output: JobOutput, section: JudgeSection, plan: SpilledItems) -> JudgedCommits:
        """The commits of a judged job, with its state continued from what earlier runs committed."""
        judge = JudgeLoop(section, plan.folder)
        judge.resume(output.storage)
        return cls(output, judge)

    def has_earlier_work(self) -> bool:
        return bool(self.judge.queue.count)

    def commit_row(self, outcome: ItemOutcome) -> None:
        """A judged render's row (``files``): the driver's verdict in it, then committed; a rejected render's image
        is deleted unless the spec keeps rejected images. A webdataset row is judged with its shard."""
        if outcome.row.get("shard_key"):
            return  # decided and committed with its shard (commit_shard)
        output, judge = self.output, self.judge
        decision = judge.decide([outcome.row])[0]
        row = decided_row(outcome.row, decision)
        if not decision.accepted and not judge.section.keep_rejected_images:
            for key in (row["image_key"], row["thumb_key"]):
                if key:
                    output.storage.delete(key)
            row.update(dict.fromkeys(("image_key", "image_uri", "thumb_key")))
        output.commit_row(row)  # its image's bytes read back under embed_images (none for a rejected image deleted)
        judge.apply([decision])

    def commit_shard(self, shard_key: str) -> bool:
        """A judged webdataset shard: the driver's verdicts written into its staged rows (and, when rejected images
        are not kept, its tar filtered off the driver) before its commit is decided; they count only once it is
        committed. False: the shard was voided (or could not be filtered) and its items render again."""
        output, judge = self.output, self.judge
        try:
            rows = read_staged_rows(output.storage, shard_key)
        except StorageError:
            return output.commit_shard(shard_key)  # nothing staged to judge: commit_shard decides what it is
        decisions = judge.decide(rows.select(_DECIDED_FROM).to_pylist())
        rows = _with_decisions(rows, decisions)
        if not judge.section.keep_rejected_images and not all(d.accepted for d in decisions):
            try:
                _without_rejected_images(output.storage, shard_key, rows, decisions)
            except Exception as e:  # the shard is not decided: void it, its items render again (the loop's retry)
                log.warning(
                    "could not filter the rejected images out of shard %s (%s); its items render again", shard_key, e
                )
                if void_staged_shard(output.storage, shard_key, by=output.holder):
                    return False
                return output.commit_shard(shard_key)  # decided committed before, unfiltered: finished as it is
            rows = _images_dropped(rows, decisions)
        replace_staged_rows(output.storage, shard_key, rows)
        committed = output.commit_shard(shard_key)
        if committed:
            judge.apply(decisions)
        return committed

    def next_render(self, item: WorkItem) -> WorkItem | None:
        return self.judge.next_render(item)  # its reference's RefKV is still open if its other items are running

    def next_round(self, plan: SpilledItems) -> PlannedWork | None:
        """What an earlier run left to render again, and the re-renders that could not join the schedule."""
        self.judge.spill_wanted()
        queued = self.judge.queue.take()
        if not queued.num_rows:
            return None
        groups, count = plan.rerender_work(queued)
        self.rounds += 1
        log.info("judge pass %d: %d item(s) an earlier run left render again", self.rounds, count)
        return PlannedWork(groups, count)

    def schedule_ended(self, skipped_items: int) -> None:
        self.judge.figures.items_skipped_by_quota += skipped_items

    def figures(self, plan: SpilledItems, images_this_run: int, *, interrupted: bool) -> CommitFigures:
        """The `judge` block; the job's items skipped by the quota are read from the output unless the run was
        interrupted (then what this run's schedule skipped is counted). A judged job's rows are renders (an item may
        have several): its items rendered are those whose first render this run committed (a re-render is made
        only once the render before it is committed)."""
        quota = self.skip_reference is not None  # set exactly when the spec has a quota
        skips = self._quota_skips(plan) if quota and not interrupted else None
        counted = skips.table.num_rows if skips is not None else None
        return CommitFigures(
            items_rendered=self.judge.figures.items_first_rendered,
            skipped_by_quota=counted,
            skipped_not_rendered=skips.not_rendered if skips is not None else 0,
            judge=self.judge.finish_figures(counted),
        )

    def _quota_skips(self, plan: SpilledItems) -> QuotaSkips | None:
        """The items skipped by the quota, from the plan and the committed rows (this run's flushed first), written
        to skipped.parquet (jobs/quota_skips.py). None when they cannot be read (the run is failing, or lost the
        output): the summary then counts what this run's schedule skipped."""
        output, section = self.output, self.judge.section
        try:
            output.fence()
            output.metadata.flush()
            skips = find_quota_skips(
                output.storage,
                lambda: plan_item_tables(run.path for run in plan.runs),
                kept_per_reference=section.kept_per_reference,
                max_renders_per_item=section.max_renders_per_item,
            )
            write_skipped(output.storage, skips)
        except (StorageError, LeaseLostError, OSError) as e:
            log.warning("could not list the items skipped by the quota (%s); summary.json counts this run's", e)
            return None
        return skips


def _with_decisions(rows: pa.Table, decisions: list[Decision]) -> pa.Table:
    for name, values, kind in (
        ("accepted", [d.accepted for d in decisions], pa.bool_()),
        ("score_near_duplicate", [d.score_near_duplicate for d in decisions], pa.int32()),
        ("rejected_by", [",".join(d.rejected_by) or None for d in decisions], pa.string()),
    ):
        rows = rows.set_column(rows.schema.get_field_index(name), name, pa.array(values, kind))
    return rows


def _without_rejected_images(storage: Storage, shard_key: str, rows: pa.Table, decisions: list[Decision]) -> None:
    """The staged tar and index rewritten with the accepted renders' members only (a Ray task when the driver runs
    one: never the driver itself), and the rejected renders' sampled thumbnails deleted."""
    keep = [d.row_id for d in decisions if d.accepted]
    nodes = [n for n in rows.column("node_id").to_pylist() if n] if "node_id" in rows.column_names else []
    _filter_off_driver(storage, shard_key, keep, nodes[0] if nodes else None)
    thumbs = rows.column("thumb_key").to_pylist()
    for thumb, decision in zip(thumbs, decisions, strict=True):
        if thumb and not decision.accepted:
            storage.delete(thumb)


def _filter_off_driver(storage: Storage, shard_key: str, keep: list[str], node_id: str | None) -> None:
    """`filter_staged_shard` in a Ray task, preferably on the node whose worker staged the shard (soft: any node
    will do, the shard is read from the output's store). It asks for no CPU: the workers may hold every CPU of the
    cluster, and a task queued behind them would stall the commit for good. Without Ray (a test of this module
    alone) it runs here."""
    import ray

    if not ray.is_initialized():
        filter_staged_shard(storage, shard_key, keep)
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict = {"num_cpus": 0, "max_retries": 2}
    if node_id:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=True)
    ray.get(ray.remote(filter_staged_shard).options(**options).remote(storage, shard_key, keep))


def _images_dropped(rows: pa.Table, decisions: list[Decision]) -> pa.Table:
    """The rows of the rejected renders name no image (their tar members are gone); the others as they were."""
    dropped = pa.array([not d.accepted for d in decisions], pa.bool_())
    for name in _IMAGE_COLUMNS:
        column = rows.column(name)
        rows = rows.set_column(
            rows.schema.get_field_index(name), name, pa.compute.if_else(dropped, pa.scalar(None, column.type), column)
        )
    return rows


__all__ = ["JudgedCommits"]
