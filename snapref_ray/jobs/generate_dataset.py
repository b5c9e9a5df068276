"""Dataset generation: a job spec in, images + Parquet metadata + errors + summary + gallery out.

`run_job` reads as its phases: 1. validate every row -> 2. take the output (storage/job_output.py: the lease,
the claim, what earlier drivers left settled) -> 3. plan what is left (committed items skipped) -> 4. render:
workers with reference affinity publish, this driver commits (through the job's `Commits`, plain or judged:
jobs/commits.py) -> 5. summarise (summary.json, a `JobSummary`), then the gallery. Interrupting (Ctrl-C, a
killed driver) loses nothing committed; running the same spec again renders only what is missing. Every write to
the output goes through the `JobOutput`, under its lease.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import resource
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from snapref_ray.cluster.metrics import job_metrics
from snapref_ray.cluster.placement import PlannedWork
from snapref_ray.cluster.pool import (
    WorkerPool,
    check_memory_fits,
    connect,
    gpus_in_cluster,
    on_a_cluster,
    plan_pool,
)
from snapref_ray.cluster.scheduler import BatchScheduler, SchedulerEvent, SchedulerStats
from snapref_ray.cluster.static_heap import static_heap
from snapref_ray.cluster.tasks import ItemOutcome, ReferenceTask, WorkerInfo
from snapref_ray.cluster.worker import WorkerConfig
from snapref_ray.job_spec import JobSpec, JobSpecError, JudgeSection, load_job_spec
from snapref_ray.jobs.commits import CommitFigures, Commits, PlainCommits
from snapref_ray.jobs.job_outcome import exit_status
from snapref_ray.jobs.job_settings import JobSettings, OutputPlace
from snapref_ray.jobs.job_summary import (
    NOT_RENDERED_KEPT,
    AttemptFigures,
    EarlierSummary,
    JobPart,
    JobSummary,
    NotRendered,
    RefKVDecisions,
    RunFigures,
    StepCacheFigures,
    TransferRate,
    job_parts,
    job_throughput,
)
from snapref_ray.jobs.judged_commit import JudgedCommits
from snapref_ray.jobs.places import check_places
from snapref_ray.jobs.run_preview import check_something_to_render, validate_manifest
from snapref_ray.jobs.spilled_items import SpilledItems, plan_against_output
from snapref_ray.render_service.memory import peak_resident_bytes
from snapref_ray.render_service.memory_estimate import memory_request
from snapref_ray.render_service.references import RefKVKey
from snapref_ray.render_service.work_items import WorkItem
from snapref_ray.requests import RenderSettings
from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.item_contents import CommittedState
from snapref_ray.storage.job_output import JobOutput
from snapref_ray.storage.lease import LeaseLostError
from snapref_ray.validation import run_reporting_usage_errors

log = logging.getLogger(__name__)

_STAGES = {"worker": "sample"}  # a worker death is reported against the sampling stage


def worker_config(
    job: JobSettings,
    *,
    warmup: bool = True,
    memory_budget_bytes: int | None = None,
    plan: SpilledItems | None = None,
) -> WorkerConfig:
    """A worker's configuration; a compiling worker warms the resolutions and forward sizes of `plan` before it is
    ready (a graph per shape: docs/performance.md, "Compile cold start")."""
    if plan is None:
        return dataclasses.replace(job.worker, warmup=warmup, memory_budget_bytes=memory_budget_bytes or None)
    return dataclasses.replace(
        job.worker,
        warmup=warmup,
        warmup_sizes=tuple(plan.sizes) or job.worker.warmup_sizes,
        warmup_batch_sizes=plan.planned_batch_sizes(job.scheduler.max_batch),
        memory_budget_bytes=memory_budget_bytes or None,
        judge_contrasts=_contrast_tasks(job.judge, plan),
    )


def _contrast_tasks(judge: JudgeSection | None, plan: SpilledItems) -> tuple[ReferenceTask, ...]:
    """The identity gap's contrast references: the job's first two, in order of first use (a render takes the
    first that is not its own: docs/judging.md)."""
    if judge is None or judge.identity_gap is None:
        return ()
    firsts = plan.first_references()
    if len(firsts) < 2:
        raise JobSpecError(
            "judge.identity_gap compares each render's reference with another reference of the job; this job has"
            " one reference"
        )
    return tuple(
        ReferenceTask(h, tuple(ref.uris), ref.layout, RefKVKey.for_settings(h, RenderSettings())) for h, ref in firsts
    )


def _driver_usage() -> tuple[float, int]:
    """(CPU seconds, peak RSS bytes) of this process so far. The peak is Linux's VmHWM, the process's own:
    ru_maxrss would carry the RSS of the process that started it (Linux keeps it across fork and exec)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, peak_resident_bytes()


@static_heap()  # the driver's start-up heap is left out of the job's GC collections (cluster/static_heap.py)
def run_job(
    spec: JobSpec,
    *,
    progress: bool = True,
    renderer_factory: Callable | None = None,
    warmup: bool = True,
    write_gallery: bool = True,
    on_progress: Callable[[int], None] | None = None,
    on_workers: Callable[[list, list], None] | None = None,
    on_event: Callable[[SchedulerEvent], None] | None = None,
) -> JobSummary:
    """Run (or resume) a batch job; returns its summary, which is also written to summary.json.

    `renderer_factory(WorkerConfig)` replaces the real Renderer in each worker (benchmarks);
    `on_progress(n)` is called after n more items are committed or failed for good;
    `on_workers([handle], [info])` once per worker as it joins the schedule (nodes come up one by
    one on an autoscaling cluster; monitoring, failure tests); `on_event(SchedulerEvent)` at each
    step of the schedule (cluster/scheduler_events.py `EVENT_KINDS`: failure tests act at exact moments
    through it). The workers are killed when the job ends, however it ends.
    """
    run = _Run(started_at=time.time())
    job = JobSettings.of(spec)  # the spec read once, into what each phase needs
    plan = _validate(job, progress=progress)  # 1. every row, before any worker starts (spilled to local disk)
    try:
        output = _take_output(job.output, plan)  # 2. the lease, what earlier runs left, the items checked, the claim
    except BaseException:
        plan.close()
        raise
    hooks = _Hooks(progress, renderer_factory, warmup, on_progress, on_workers, on_event)
    try:
        _record_invalid_rows(plan, output)  # 3. what is left to render, logged; invalid rows recorded once
        _render(job, plan, output, run, hooks)  # 4. workers publish, this driver commits
    except KeyboardInterrupt:
        run.interrupted = True
        log.warning("interrupted: committing what is done; run the same spec again to resume")
        raise
    except LeaseLostError:
        output.abandon()  # another driver holds the output now: nothing more is written to it
        raise
    finally:
        try:
            summary = _summarise(job, plan, output, run)  # 5. summary.json, then compaction, under the lease
        finally:
            plan.close()  # after the summary: a judged job's items skipped by the quota are read from the plan
        output.finish(summary.to_json(), compact=not run.interrupted)
    if write_gallery:
        _write_gallery(job.output)
    log.info("done: %s", json.dumps({k: getattr(summary, k) for k in _LOGGED}))
    return summary


_LOGGED = ("images_total", "images_this_run", "failed_items", "images_per_hour")


@dataclass
class _Hooks:
    """What the caller plugs into a run (see run_job)."""

    progress: bool
    renderer_factory: Callable | None
    warmup: bool
    on_progress: Callable[[int], None] | None
    on_workers: Callable[[list, list], None] | None
    on_event: Callable[[SchedulerEvent], None] | None


@dataclass
class _Run:
    """This driver run's figures, gathered as images are committed (summary.json reports them)."""

    started_at: float
    interrupted: bool = False
    cpu_at_start: float = field(default_factory=lambda: _driver_usage()[0])
    stats: SchedulerStats | None = None
    encodes_by_reference: Counter[str] = field(default_factory=Counter)
    startup_seconds: float = 0.0
    render_seconds: float = 0.0
    images_per_node: Counter[str] = field(default_factory=Counter)
    forward_batches: Counter[int] = field(default_factory=Counter)
    memory_by_worker: dict[str, list[dict]] = field(default_factory=dict)  # each worker's latest memory fit
    memory_request: dict = field(default_factory=dict)  # what each worker asked Ray for, and the estimate behind it
    step_cache: StepCacheFigures = field(default_factory=StepCacheFigures)  # images rendered with the step cache on
    cold_starts: dict[str, dict] = field(default_factory=dict)  # per worker, as it reported when ready
    commits: Commits | None = None  # the job's commits, once the output is taken (their figures: summary.json)
    failures: list[NotRendered] = field(default_factory=list)  # the first items that failed for good (the summary's)
    replaced: int = 0  # images that replaced one the output held under the same id (rerender_changed)

    def item_failed(self, outcome: ItemOutcome, item: WorkItem) -> None:
        if len(self.failures) < NOT_RENDERED_KEPT:
            reason = outcome.error or "unknown error"
            self.failures.append(
                NotRendered(kind="failed item", manifest_row=item.manifest_row, item_id=item.item_id, reason=reason)
            )

    def image_done(self, outcome: ItemOutcome) -> None:
        row = outcome.row
        self.images_per_node[row.get("node_id") or "?"] += 1
        self.forward_batches[row.get("forward_batch") or 0] += 1
        if outcome.memory is not None:
            self.memory_by_worker[row["worker_id"]] = outcome.memory
        if row.get("skipped_forwards") is not None:
            self.step_cache.images += 1
            self.step_cache.forwards_saved += row["skipped_forwards"]
            self.step_cache.forwards += row["steps"]


def _validate(job: JobSettings, *, progress: bool = False) -> SpilledItems:
    """Phase 1: every manifest row checked, a chunk at a time, and the valid items spilled to local disk
    (jobs/spilled_items.py); a strict spec with an invalid row stops here, naming them."""
    plan = validate_manifest(job.manifest, job.model, progress=progress)
    try:
        check_something_to_render(job.manifest.manifest, plan)  # every row invalid: say why, and write nothing
    except BaseException:
        plan.close()
        raise
    return plan


def _take_output(place: OutputPlace, plan: SpilledItems) -> JobOutput:
    """Phase 2: the output, held by this driver (storage/job_output.py): the same spec resumes, `append` adds to
    another job's output; what earlier runs committed is read, and the plan's explicit ids are checked against it
    before the claim writes anything: ids committed with other content, or by another job, are refused in one line
    (or rendered again with `rerender_changed`; jobs/spilled_items.py, storage/item_contents.py)."""

    def admit(committed: CommittedState) -> None:
        plan_against_output(plan, committed, rerender_changed=place.rerender_changed)

    return JobOutput.open(open_storage(place.uri, place.s3), place.settings, admit=admit)


def _record_invalid_rows(plan: SpilledItems, output: JobOutput) -> None:
    """Phase 3: the items not committed yet (a bit per item of the plan); the invalid rows go to errors/, once per
    output (a resumed job validates the same manifest again)."""
    # The committed items were marked when the output was taken (`admit` in _take_output).
    log.info(
        "%d manifest rows -> %d items (%d invalid rows); %d already committed, %d to render (%d references)",
        plan.rows,
        plan.items,
        plan.invalid_rows,
        plan.committed,
        plan.to_render,
        plan.references_to_render,
    )
    recorded = output.recorded_validation_errors() if plan.error_count else set()
    for e in plan.all_errors():
        message = f"{'field ' + repr(e.field) + ': ' if e.field else ''}{e.error}"
        if (e.manifest_row, e.item_id, message) not in recorded:
            output.record_error(message, "validate", item_id=e.item_id, manifest_row=e.manifest_row)


def _render(job: JobSettings, plan: SpilledItems, output: JobOutput, run: _Run, hooks: _Hooks) -> None:
    """Phase 4: start the pool, run the schedule over the plan's references, commit each image's row (each staged
    shard) as it lands, through the job's `Commits` (jobs/commits.py: as it is, or judged first); the workers are
    killed however it ends. What the commits ask to render next joins the running schedule; a round they ask for
    after it (a judged job's re-renders an earlier run left) runs on the same pool, until none is left."""
    commits = _commits(job.judge, plan, output)
    run.commits = commits
    if not plan.to_render and not commits.has_earlier_work():
        return
    pool = _start_pool(job, plan, run, hooks)
    bar = _progress_bar(plan.items, plan.committed) if hooks.progress else None
    callbacks = [f for f in (bar.update if bar else None, hooks.on_progress) if f is not None]

    def done(outcome: ItemOutcome, item: WorkItem) -> None:
        run.image_done(outcome)
        if plan.rerendered and item.item_id in output.done_before:
            run.replaced += 1  # an edited row rendered again: the output held its id already (images_total)
        commits.commit_row(outcome)
        if (render := commits.next_render(item)) is not None:
            scheduler.add([render])

    def joined(handle, info: WorkerInfo) -> None:
        if info.cold_start:
            run.cold_starts[info.worker_id] = info.cold_start
        if hooks.on_workers:
            hooks.on_workers([handle], [info])

    scheduler = BatchScheduler(
        [],
        [],
        job.scheduler,
        on_done=done,
        on_failed=lambda outcome, item, attempt: (
            run.item_failed(outcome, item),
            _record_failure(output, outcome, item, attempt),
        ),
        on_progress=(lambda n: [f(n) for f in callbacks]) if callbacks else None,
        pool=pool,
        on_worker=joined,
        on_event=hooks.on_event,
        fence=output.fence,
        commit_shard=commits.commit_shard,
        skip_reference=commits.skip_reference,
        adds_work=commits.adds_work,
    )
    run.encodes_by_reference = scheduler.encodes_by_reference
    run.stats = scheduler.stats  # interrupted or failed: what was done still counts
    t_schedule = time.time()
    lost = False
    try:
        work: PlannedWork | None = PlannedWork(plan.reference_groups(), plan.to_render)
        while work is not None:
            if work.items:
                scheduler.run(work)
            work = commits.next_round(plan)
        commits.schedule_ended(scheduler.skipped_items)
    except LeaseLostError:
        lost = True  # another driver holds the output: the workers are not asked to publish what they hold
        raise
    finally:
        # Start-up ends when min_workers are ready (inside run); rendering is the rest.
        waited = scheduler.stats.seconds_to_start
        run.startup_seconds = t_schedule - run.started_at + waited
        run.render_seconds = time.time() - t_schedule - waited
        scheduler.release_workers(publish=not lost)
        if bar:
            bar.close()


def _commits(section: JudgeSection | None, plan: SpilledItems, output: JobOutput) -> Commits:
    """The job's commits: judged ones continue from what earlier runs committed (jobs/judged_commit.py)."""
    if section is None:
        return PlainCommits(output)
    return JudgedCommits.resume(output, section, plan)


def _start_pool(job: JobSettings, plan: SpilledItems, run: _Run, hooks: _Hooks) -> WorkerPool:
    """Connect to Ray and size the pool: GPU or CPU workers, how many, and the memory each asks for (at the job's
    largest image and max_batch)."""
    pool = job.pool
    connect(pool.address)
    on_cluster = on_a_cluster(pool.address)
    pool_plan = plan_pool(pool.shape, pool.device, on_cluster=on_cluster, gpus_now=gpus_in_cluster())
    log.info(
        "worker pool: %d to %d %s worker(s)",
        pool_plan.min_workers,
        pool_plan.max_workers,
        "GPU" if pool_plan.use_gpu else "CPU",
    )
    memory_bytes, estimate = memory_request(
        job.model,
        override=pool.memory_per_worker,
        width=plan.largest.width,
        height=plan.largest.height,
        batch=pool.max_batch,
        on_gpu=pool_plan.use_gpu,
    )
    if not memory_bytes and pool.memory_per_worker is None:
        log.info("model files are remote: workers ask Ray for no memory (set cluster.memory_per_worker)")
    pool_plan = dataclasses.replace(pool_plan, memory_bytes=memory_bytes)
    run.memory_request.update(bytes=memory_bytes, estimate=estimate.report() if estimate else None)
    check_memory_fits(pool_plan, on_cluster=on_cluster)
    config = worker_config(
        job, warmup=hooks.warmup, memory_budget_bytes=None if pool_plan.use_gpu else memory_bytes, plan=plan
    )
    return WorkerPool(config, pool_plan, hooks.renderer_factory)


def _summarise(job: JobSettings, plan: SpilledItems, output: JobOutput, run: _Run) -> JobSummary:
    """Phase 5: this run's figures, and the job's over every run on this output."""
    stats = run.stats or SchedulerStats()
    now = time.time()
    this_run = RunFigures(
        job=output.settings.fingerprint,
        started_at=run.started_at,
        finished_at=now,
        items_to_render=plan.to_render,
        images=stats.done_items,
        failed_items=stats.failed_items,
        interrupted=run.interrupted,
        wall_seconds=round(now - run.started_at, 3),
        driver_cpu_seconds=round(_driver_usage()[0] - run.cpu_at_start, 3),
        driver_peak_rss_bytes=_driver_usage()[1],
        startup_seconds=round(run.startup_seconds, 3),
        render_seconds=round(run.render_seconds, 3),
        manifest_sha256=plan.manifest_sha256,
    )
    earlier = EarlierSummary.of(output.earlier_summary, where=output.storage.uri_for("summary.json"))
    runs = [*earlier.runs, this_run]
    by_commits = (  # none: the run failed before its render phase
        run.commits.figures(plan, stats.done_items, interrupted=run.interrupted)
        if run.commits is not None
        else CommitFigures(items_rendered=stats.done_items)
    )
    job_images = plan.committed + by_commits.items_rendered
    this_job = JobPart(
        job=output.settings.fingerprint,
        manifest=plan.manifest,
        manifest_rows=plan.rows,
        invalid_rows=plan.invalid_rows,
        items=plan.items,
        images=job_images,
        failed_items=stats.failed_items,
        finished_at=now,
    )
    throughput = job_throughput(runs)  # the output's, over its runs that had work
    jobs = job_parts(earlier.jobs, this_job)
    invalid = [
        NotRendered(kind="invalid row", manifest_row=e.manifest_row, item_id=e.item_id, reason=_reason(e))
        for e in _first_per_row(plan.errors_head, NOT_RENDERED_KEPT)
    ]
    references = plan.references_to_render
    measured = stats.measured_transfer_bytes_per_s
    return JobSummary(
        manifest=plan.manifest,
        output=job.output.uri,
        config_hash=output.settings.fingerprint,
        manifest_rows=plan.rows,
        invalid_rows=plan.invalid_rows,  # a row with two errors is one invalid row
        items=plan.items,
        # The whole output: what earlier runs of any job committed, and this run's new ids.
        images_total=len(output.done_before or ()) + stats.done_items - run.replaced,
        job_images=job_images,
        images_this_run=stats.done_items,
        skipped_already_done=plan.committed,
        failed_items=stats.failed_items,
        committed_not_in_manifest=plan.committed_not_in_manifest,
        skipped_by_quota=by_commits.skipped_by_quota,
        skipped_not_rendered=by_commits.skipped_not_rendered,
        not_rendered=[*invalid, *run.failures],
        attempts=AttemptFigures(
            max_attempts=job.max_attempts,
            charged=stats.attempts_charged,
            retried_items=stats.retried_items,
            failed_items=stats.failed_items,
        ),
        requeues={**stats.requeues, "budget": stats.requeue_budget},
        interrupted=run.interrupted,
        **throughput,
        references=references,
        reference_encodes=stats.reference_encodes,
        encodes_per_reference=round(stats.reference_encodes / references, 3) if references else 0.0,
        max_encodes_per_reference=max(run.encodes_by_reference.values(), default=0),
        images_per_node=dict(sorted(run.images_per_node.items())),
        peak_workers=stats.peak_workers,
        forward_batches={str(k): v for k, v in sorted(run.forward_batches.items())},
        step_cache=run.step_cache if run.step_cache.images else None,
        memory_per_worker=run.memory_request or None,
        memory_fit=[{"worker_id": w, **fit} for w, fits in sorted(run.memory_by_worker.items()) for fit in fits],
        batch_limits=stats.batch_limits,
        cold_start=[{"worker_id": w, **c} for w, c in sorted(run.cold_starts.items())],
        refkv_decisions=RefKVDecisions(
            same_node_fetches=stats.same_node_fetches,
            cross_node_fetches=stats.cross_node_fetches,
            cross_node_reencodes=stats.local_encodes,
            transfer_gbps=TransferRate(
                configured=job.transfer_gbps, measured=round(8 * measured / 1e9, 3) if measured else None
            ),
        ),
        scheduler=asdict(run.stats) if run.stats else None,
        judge=by_commits.judge,
        finished_at=now,
        jobs=jobs,
        runs=runs,
    )


def _reason(error) -> str:
    """A row error as the errors table records it: `field 'x': why`."""
    return f"{'field ' + repr(error.field) + ': ' if error.field else ''}{error.error}"


def _first_per_row(errors: list, n: int) -> list:
    """The first error of each of the first `n` invalid rows (a row with two errors is one invalid row)."""
    seen: dict[int, object] = {}
    for error in errors:
        if len(seen) >= n:
            break
        seen.setdefault(error.manifest_row, error)
    return list(seen.values())


def _write_gallery(place: OutputPlace) -> None:
    from snapref_ray.report import write_report

    try:
        write_report(place.uri, place.s3)
    except Exception as e:  # a report must never fail a finished job
        log.warning("could not write the gallery: %s", e)


def _record_failure(output: JobOutput, outcome: ItemOutcome, item: WorkItem, attempt: int) -> None:
    log.error(
        "item %s (manifest row %d) failed after %d attempt(s): %s",
        item.item_id,
        item.manifest_row,
        attempt,
        outcome.error,
    )
    job_metrics().errors.inc(1, {"stage": _STAGES.get(outcome.stage, outcome.stage)})
    output.record_error(
        outcome.error or "unknown error",
        _STAGES.get(outcome.stage, outcome.stage),
        item_id=item.item_id,
        manifest_row=item.manifest_row,
        attempt=attempt,
    )


def _progress_bar(total: int, initial: int):
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc="images",
        unit="img",
        smoothing=0.1,
        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]",
    )


JOB_USAGE = """`ray job submit --working-dir . -- python -m jobs.generate_dataset SPEC.yaml`

Runs a dataset-generation job spec on the cluster the job was submitted to (RAY_ADDRESS is
set by `ray job submit`); resubmitting the same spec resumes it.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=JOB_USAGE)
    parser.add_argument("spec", help="job spec YAML (local or s3://)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    parser.add_argument("--allow-invalid", action="store_true", help="exit 0 when only invalid rows were left out")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def job() -> int:
        spec = load_job_spec(args.spec)
        check_places(spec, spec.manifest)  # one line for a place that cannot work, not minutes of retries
        summary = run_job(spec, progress=not args.no_progress)
        return exit_status(summary, allow_invalid=args.allow_invalid)

    return run_reporting_usage_errors(job)
