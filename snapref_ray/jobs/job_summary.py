"""`JobSummary`: what a dataset-generation job reports at the end of each run, and what summary.json holds.

`run_job` (snapref_ray/jobs/generate_dataset.py) returns it, the CLI prints it, and summary.json is its JSON form (the
gallery in snapref_ray/report/ reads the file). One output can take several driver runs (an interrupted job run
again, an appended manifest): `runs` keeps each run's figures, and the throughput at the top is the job's, over the
runs that had work, so a resume that finds nothing to render never writes the job's throughput down to 0.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class RunFigures(BaseModel):
    """One driver run of the job: what it rendered and how long it took."""

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
    scheduler's figures are this run's; `images_total` and the throughput are the job's."""

    manifest: str
    output: str
    config_hash: str
    manifest_rows: int
    invalid_rows: int
    items: int = Field(description="Valid items of the manifest.")
    images_total: int = Field(description="Items of this manifest committed in the output, by any run.")
    images_this_run: int
    skipped_already_done: int = Field(description="Items committed by earlier runs, not rendered again.")
    failed_items: int = Field(description="Items this run gave up on (errors/ holds their reasons).")
    attempts: AttemptFigures
    requeues: dict[str, int] = Field(description="Items requeued without an attempt, by cause; `budget`: the cap.")
    interrupted: bool
    wall_seconds: float = Field(description="The job's: the wall time of the runs that had work.")
    images_per_hour: float = Field(description="The job's: images of those runs per hour of their wall time.")
    startup_seconds: float = Field(description="The job's: seconds until rendering began, summed over those runs.")
    render_seconds: float = Field(description="The job's: seconds of rendering, summed over those runs.")
    images_per_hour_rendering: float = Field(description="The job's images per hour of rendering.")
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
    finished_at: float
    runs: list[RunFigures] = Field(description="Each driver run on this output, oldest first; the last is this one.")

    def to_json(self) -> dict[str, Any]:
        """summary.json's content."""
        return self.model_dump(mode="json")


def job_throughput(runs: list[RunFigures]) -> dict[str, float]:
    """The job's time and throughput over the runs that had work (a run with nothing to render adds nothing)."""
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
