"""`JobSummary`: what a dataset-generation job reports at the end of each run, and what summary.json holds.

`run_job` (snapref_ray/jobs/generate_dataset.py) returns it, the CLI prints it, and summary.json is its JSON form (the
gallery in snapref_ray/report/ reads the file). One output can take several driver runs (an interrupted job run
again, an appended manifest): `runs` keeps each run's figures, and the throughput at the top is the output's, over the
runs that had work, so a resume that finds nothing to render never writes the throughput down to 0. An output
can also hold several jobs' images (`--append`): `images_total` counts all of them, `jobs` has each job's part,
and every run names the job it rendered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

log = logging.getLogger(__name__)


class RunFigures(BaseModel):
    """One driver run of the job: what it rendered and how long it took."""

    job: str | None = Field(
        None,
        description="Fingerprint of the job the run rendered (job.json; the metadata's `job` column); None in a"
        " summary written before runs named their job.",
    )
    started_at: float = Field(description="Unix time the driver run started.")
    finished_at: float = Field(description="Unix time its summary was written.")
    items_to_render: int = Field(description="Items the run found not yet committed (0: nothing to do).")
    images: int = Field(description="Images the run committed.")
    failed_items: int = Field(0, description="Items that failed for good in this run.")
    interrupted: bool = Field(False, description="The run ended on Ctrl-C or a killed driver.")
    wall_seconds: float = Field(description="From the run's start to its summary.")
    startup_seconds: float = Field(0.0, description="Until min_workers were ready and rendering began.")
    render_seconds: float = Field(0.0, description="From the first render to the end of the schedule.")
    driver_cpu_seconds: float | None = Field(
        None,
        description="CPU seconds of the driver process during the run (validation, planning, the schedule, commits):"
        " what one driver costs per item, apart from the workers.",
    )
    driver_peak_rss_bytes: int | None = Field(None, description="The driver process's peak resident memory.")
    manifest_sha256: str | None = Field(
        None, description="sha256 of the manifest's bytes as this run read them: which version of it the run rendered."
    )

    @staticmethod
    def from_earlier_summary(summary: dict) -> list[RunFigures]:
        """The runs recorded in an earlier summary.json; one written before `runs` existed holds one run."""
        if "runs" in summary:
            return [RunFigures.model_validate(run) for run in summary["runs"]]
        if "images_this_run" not in summary or "wall_seconds" not in summary:
            return []
        finished = float(summary.get("finished_at", 0.0))
        return [
            RunFigures(
                started_at=finished - float(summary["wall_seconds"]),
                finished_at=finished,
                # Throughput was only ever recorded for runs that rendered: count them as having had work.
                items_to_render=int(summary["images_this_run"]) + int(summary.get("failed_items", 0)),
                images=int(summary["images_this_run"]),
                failed_items=int(summary.get("failed_items", 0)),
                interrupted=bool(summary.get("interrupted", False)),
                wall_seconds=float(summary["wall_seconds"]),
                startup_seconds=float(summary.get("startup_seconds", 0.0)),
                render_seconds=float(summary.get("render_seconds", 0.0)),
            )
        ]


class JobPart(BaseModel):
    """One job's part of the output, as its latest run left it: an output that another job was appended to holds
    several, and the runs of each name it (`RunFigures.job`)."""

    job: str = Field(description="The job's fingerprint (job.json; the metadata's `job` column).")
    manifest: str
    manifest_rows: int
    invalid_rows: int = Field(description="Manifest rows that did not validate: never rendered (errors/).")
    items: int = Field(description="Valid items of the manifest.")
    images: int = Field(description="The job's items committed in the output, by any of its runs.")
    failed_items: int = Field(description="Items its latest run gave up on (errors/).")
    finished_at: float = Field(description="Unix time of its latest run's summary.")

    @staticmethod
    def from_earlier_summary(summary: dict) -> list[JobPart]:
        """The jobs an earlier summary.json recorded; one written before `jobs` existed describes one job."""
        if "jobs" in summary:
            return [JobPart.model_validate(part) for part in summary["jobs"]]
        needed = ("config_hash", "manifest", "manifest_rows", "invalid_rows", "items", "images_total")
        if not all(key in summary for key in needed):
            return []
        return [
            JobPart(
                job=summary["config_hash"],
                manifest=summary["manifest"],
                manifest_rows=int(summary["manifest_rows"]),
                invalid_rows=int(summary["invalid_rows"]),
                items=int(summary["items"]),
                # Before `jobs`, images_total counted the job's own items: the part is what it said.
                images=int(summary["images_total"]),
                failed_items=int(summary.get("failed_items", 0)),
                finished_at=float(summary.get("finished_at", 0.0)),
            )
        ]


class NotRendered(BaseModel):
    """A manifest row or item the job left out of the output, and why (the first few are in the summary; errors/
    and errors.html hold every one)."""

    kind: str = Field(description='"invalid row" (did not validate) or "failed item" (its render failed for good).')
    manifest_row: int | None
    item_id: str | None
    reason: str

    def __str__(self) -> str:
        if self.kind == "invalid row":
            return f"invalid row {self.manifest_row}: {self.reason}"
        return f"failed item {self.item_id} (manifest row {self.manifest_row}): {self.reason}"


NOT_RENDERED_KEPT = 5  # rows named in the summary and on the terminal; errors/ holds them all


class AttemptFigures(BaseModel):
    """An attempt is an item's own failure (an error raised rendering it); work the cluster lost is requeued
    without one, counted by cause under `requeues` (cluster/failures.py)."""

    max_attempts: int
    charged: int = 0
    retried_items: int = 0
    failed_items: int = 0


class StepCacheFigures(BaseModel):
    """DiT forwards the step cache let images skip (each image's rows skip or run together): of the forwards the
    images with the cache on would have run, how many they did not."""

    images: int = 0
    forwards: int = 0
    forwards_saved: int = 0


class TransferRate(BaseModel):
    configured: float | None = Field(description="cluster.transfer_gbps, if set.")
    measured: float | None = Field(description="Gbit/s of the first cross-node RefKV fetch, when one was measured.")


class RefKVDecisions(BaseModel):
    """How RefKVs reached the workers that did not encode them (cluster/placement.py)."""

    same_node_fetches: int = 0
    cross_node_fetches: int = 0
    cross_node_reencodes: int = 0
    transfer_gbps: TransferRate


class JobSummary(BaseModel):
    """The summary of a job's output after a run; `to_json()` is summary.json. Counts named `_this_run` and the
    scheduler's figures are this run's; `manifest` to `failed_items` are this job's; `images_total`, `jobs`, `runs`
    and the throughput are the output's (all its jobs': an appended output holds several)."""

    manifest: str
    output: str
    config_hash: str = Field(description="This job's fingerprint (job.json; the metadata's `job` column).")
    manifest_rows: int
    invalid_rows: int = Field(description="This job's manifest rows that did not validate: never rendered (errors/).")
    items: int = Field(description="Valid items of the manifest.")
    images_total: int = Field(description="Images in the output: every job's (`jobs` has each one's part).")
    job_images: int = Field(description="This job's items committed in the output, by any of its runs.")
    images_this_run: int
    skipped_already_done: int = Field(description="Items committed by earlier runs, not rendered again.")
    failed_items: int = Field(description="Items this run gave up on (errors/ holds their reasons).")
    committed_not_in_manifest: int | None = Field(
        None,
        description="Committed items of this job that no manifest row produces any more (rows removed, ids changed);"
        " they stay in the output. None where the output holds other jobs' items and its rows do not say whose.",
    )
    skipped_by_quota: int | None = Field(
        None,
        description="A judged job with judge.kept_per_reference: its items skipped by the quota — their reference has"
        " its kept images, so they were not rendered (again); nothing failed. skipped.parquet lists each (item_id,"
        " manifest_row, reason). Counted over the output, once however many runs skipped them. None: no quota.",
    )
    skipped_not_rendered: int = Field(
        0, description="Of the items skipped by the quota, those with no render at all (not in the output, not failed)."
    )
    not_rendered: list[NotRendered] = Field(
        default_factory=list,
        description=f"The first {NOT_RENDERED_KEPT} invalid rows, then the first {NOT_RENDERED_KEPT} failed items of"
        " this run, with their reasons (errors/ and errors.html hold every one).",
    )
    attempts: AttemptFigures
    requeues: dict[str, int] = Field(description="Items requeued without an attempt, by cause; `budget`: the cap.")
    interrupted: bool
    wall_seconds: float = Field(description="The output's: the wall time of the runs that had work.")
    images_per_hour: float = Field(description="The output's: images of those runs per hour of their wall time.")
    startup_seconds: float = Field(description="The output's: seconds until rendering began, summed over those runs.")
    render_seconds: float = Field(description="The output's: seconds of rendering, summed over those runs.")
    images_per_hour_rendering: float = Field(description="The output's images per hour of rendering (the gallery's).")
    references: int = Field(description="References among this run's items.")
    reference_encodes: int = Field(
        description="Reference-stream runs the workers reported (not the driver's requests): a worker that had to "
        "re-encode (evicted, restarted) shows here."
    )
    encodes_per_reference: float
    max_encodes_per_reference: int
    images_per_node: dict[str, int]
    peak_workers: int
    forward_batches: dict[str, int] = Field(
        description="Images by the size of the forward that rendered them: the batch the workers chose (on a GPU, "
        "the largest that fits the resolution, capped by max_batch; see render_service/memory.py)."
    )
    step_cache: StepCacheFigures | None = Field(description="None when no image ran with the step cache on.")
    memory_per_worker: dict[str, Any] | None = Field(
        description="The host memory each worker asked Ray for (cluster.memory_per_worker, or the estimate's figures)."
    )
    memory_fit: list[dict[str, Any]] = Field(
        description="Per worker and resolution: one image's peak, what each further image adds, the batch chosen."
    )
    batch_limits: list[dict[str, Any]] = Field(
        description="The batch cap per (width, height, rows per image): max_batch, or less where a batch ran out of "
        "memory and was halved (out_of_memory_splits times)."
    )
    cold_start: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Per worker of this run, as it reported when ready: model load, compile (graphs built or loaded "
        "from the compile cache), warm-up and first-image seconds (render_service/cold_start.py).",
    )
    refkv_decisions: RefKVDecisions
    scheduler: dict[str, Any] | None = Field(description="This run's SchedulerStats (cluster/scheduler_stats.py).")
    judge: dict[str, Any] | None = Field(
        None,
        description="A judged job's figures (jobs/judge_loop.py `JudgeFigures`), over every run on the output:"
        " renders, kept, rejected (and per check), items left without a kept image (this run), items skipped by the"
        " quota (the output's: skipped_by_quota), renders_per_kept_image, gpu_seconds_per_kept_image. None when the"
        " job does not judge.",
    )
    finished_at: float
    jobs: list[JobPart] = Field(
        default_factory=list, description="Each job's part of the output, in the order they first ran; this one's too."
    )
    runs: list[RunFigures] = Field(description="Each driver run on this output, oldest first; the last is this one.")

    @property
    def unrendered_items(self) -> int:
        """This job's valid items that are not in the output: they failed (or their shard was lost) and a run of the
        same command renders them again. Items skipped by the quota are not among them."""
        return max(0, self.items - self.job_images - self.skipped_not_rendered)

    @property
    def rendered_nothing_new(self) -> bool:
        """This run found every item of the job committed already (a resume of a finished job)."""
        return bool(self.runs) and self.runs[-1].items_to_render == 0

    def to_json(self) -> dict[str, Any]:
        """summary.json's content."""
        return self.model_dump(mode="json")


@dataclass(frozen=True)
class EarlierSummary:
    """What a run carries on from the summary.json an earlier run wrote: its runs and its jobs' parts, read once."""

    runs: list[RunFigures]
    jobs: list[JobPart]

    @classmethod
    def of(cls, summary: dict | None, *, where: str) -> EarlierSummary:
        """`summary` (None: there was none) read; a part that cannot be read is left out, and told once, naming
        `where` the file is (a driver killed while writing it: the figures start again from this run)."""
        if not summary:
            return cls([], [])
        try:
            runs = RunFigures.from_earlier_summary(summary)
        except (ValueError, TypeError, KeyError) as e:  # pydantic's ValidationError is a ValueError
            log.warning("%s cannot be read (%s); its earlier runs are not counted", where, e)
            runs = []
        try:
            jobs = JobPart.from_earlier_summary(summary)
        except (ValueError, TypeError, KeyError):  # told once, above
            jobs = []
        return cls(runs, jobs)


def job_parts(earlier: list[JobPart], this_job: JobPart) -> list[JobPart]:
    """The output's jobs after this run: the earlier parts, this job's replaced by (or added as) `this_job`."""
    parts = [this_job if part.job == this_job.job else part for part in earlier]
    return parts if any(part.job == this_job.job for part in earlier) else [*parts, this_job]


def job_throughput(runs: list[RunFigures]) -> dict[str, float]:
    """The output's time and throughput over the runs that had work (a run with nothing to render adds nothing)."""
    working = [r for r in runs if r.items_to_render]
    images = sum(r.images for r in working)
    wall = sum(r.wall_seconds for r in working)
    render = sum(r.render_seconds for r in working)
    return {
        "wall_seconds": round(wall, 3),
        "images_per_hour": round(3600 * images / wall, 1) if wall > 0 else 0.0,
        "startup_seconds": round(sum(r.startup_seconds for r in working), 3),
        "render_seconds": round(render, 3),
        "images_per_hour_rendering": round(3600 * images / render, 1) if render > 0 else 0.0,
    }
