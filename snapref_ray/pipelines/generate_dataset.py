"""Dataset generation: a job spec in, images + Parquet metadata + errors + summary + gallery out.

validate every row -> claim the output (same spec, or append) -> skip committed items ->
workers render with reference affinity -> rows committed as images land -> summary, gallery.
Interrupting (Ctrl-C, a killed driver) loses nothing committed; running the same spec again
renders only what is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict

from snapref_ray.cluster.failures import REQUEUE_CAUSES
from snapref_ray.cluster.metrics import job_metrics
from snapref_ray.cluster.pool import (
    PoolShape,
    WorkerPool,
    check_memory_fits,
    connect,
    gpus_in_cluster,
    kill,
    on_a_cluster,
    plan_pool,
    worker_memory,
)
from snapref_ray.cluster.scheduler import BatchScheduler, SchedulerConfig, SchedulerEvent
from snapref_ray.cluster.tasks import ItemOutcome
from snapref_ray.cluster.worker import WorkerConfig
from snapref_ray.service.loading import adapter_kind
from snapref_ray.service.work_items import JobValidationError, WorkItem, load_work_items
from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.jobspec import JobSpec, JobSpecError, load_job_spec, spec_fingerprint
from snapref_ray.storage.lease import OutputLease
from snapref_ray.storage.ledger import claim_output, committed_item_ids, job_fingerprint
from snapref_ray.storage.metadata import (
    ErrorWriter,
    MetadataWriter,
    compact_parts,
    read_errors_table,
    write_summary,
)
from snapref_ray.storage.shards import remove_orphan_shards
from snapref_ray.validation import run_reporting_usage_errors

log = logging.getLogger(__name__)

_STAGES = {"worker": "sample"}  # a worker death is reported against the sampling stage


def worker_config(spec: JobSpec, *, warmup: bool = True, memory_budget_bytes: int | None = None) -> WorkerConfig:
    c = spec.cluster
    return WorkerConfig(
        model=spec.model,
        refkv_cache_bytes=c.refkv_cache_bytes,
        output_uri=spec.output.uri,
        s3=spec.s3_options(),
        image_format=spec.output.image_format,
        warmup=warmup,
        output_threads=c.output_threads,
        warmup_sizes=((spec.defaults.width, spec.defaults.height),),
        refkv_fetch_timeout_s=c.refkv_fetch_timeout_s,
        memory_budget_bytes=memory_budget_bytes or None,
        output_format=spec.output.format,
        shard_max_bytes=spec.output.shard_max_bytes,
        shard_max_items=spec.output.shard_max_items,
        thumbnail_every=spec.output.thumbnail_every,
    )


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
) -> dict:
    """Run (or resume) a batch job; returns the summary that is also written to summary.json.

    `renderer_factory(WorkerConfig)` replaces the real Renderer in each worker (benchmarks);
    `on_progress(n)` is called after n more items are committed or failed for good;
    `on_workers([handle], [info])` once per worker as it joins the schedule (nodes come up one by
    one on an autoscaling cluster; monitoring, failure tests); `on_event(SchedulerEvent)` at each
    step of the schedule (cluster/scheduler.py `EVENT_KINDS`: failure tests act at exact moments
    through it). The workers are killed when the job ends, however it ends.
    """
    t_start = time.time()
    s3 = spec.s3_options()
    storage = open_storage(spec.output.uri, s3)
    kind = adapter_kind(spec.model, s3=s3)
    if kind is None:
        raise JobSpecError(
            "no reference adapter: set model.adapter in the job spec (--adapter), or put adapter.safetensors in"
            f" the models folder ({spec.model.models_dir})"
        )
    validated = load_work_items(spec, s3, adapter_kind=kind)
    if validated.errors and spec.strict:
        raise JobValidationError(spec.manifest, validated.errors)
    fingerprint = job_fingerprint(spec_fingerprint(spec))
    claim_output(storage, fingerprint, spec_fingerprint(spec), append=spec.output.append)
    # One driver per output (storage/lease.py): held from before the committed set is read to the summary.
    lease = OutputLease.acquire(storage, duration_s=spec.output.lease_seconds, wait_s=spec.output.lease_wait_seconds)
    if spec.output.format == "webdataset":
        remove_orphan_shards(storage)  # shards a killed worker published but never committed
    compact_parts(storage)  # metadata parts stay few and large as the job grows (storage/metadata.py)

    done_before = committed_item_ids(storage)
    done_mask = done_before.contains([item.item_id for item in validated.items])  # vectorised (storage/ledger.py)
    todo = [item for item, done in zip(validated.items, done_mask) if not done]
    log.info(
        "%d manifest rows -> %d items (%d invalid rows); %d already committed, %d to render",
        validated.rows,
        len(validated.items),
        len(validated.errors),
        len(validated.items) - len(todo),
        len(todo),
    )

    metadata = MetadataWriter(
        storage,
        embed_images=spec.output.embed_images,
        flush_seconds=spec.output.metadata_flush_seconds,
        guard=lease.check,
    )
    errors = ErrorWriter(storage)
    # A resumed job validates the same manifest again: record each invalid row once per output.
    recorded = _recorded_validation_errors(storage) if validated.errors else set()
    for e in validated.errors:
        message = f"{'field ' + repr(e.field) + ': ' if e.field else ''}{e.error}"
        if (e.manifest_row, e.item_id, message) not in recorded:
            errors.record(message, "validate", item_id=e.item_id, manifest_row=e.manifest_row)

    stats = None
    scheduler = None
    pool = None
    images_per_node: Counter[str] = Counter()
    forward_batches: Counter[int] = Counter()
    memory_by_worker: dict[str, list[dict]] = {}  # each worker's latest memory fit (service/memory.py)
    memory_request: dict = {}  # what each worker asked Ray for, and the estimate behind it
    step_cache = {"images": 0, "forwards": 0, "forwards_saved": 0}  # images rendered with the step cache on
    bar = None
    interrupted = False
    timing = {"startup_seconds": 0.0, "render_seconds": 0.0}
    try:
        if todo:
            c = spec.cluster
            connect(c.address)
            plan = plan_pool(
                PoolShape(
                    c.num_workers,
                    c.cpu_workers,
                    c.num_cpus_per_worker,
                    min_workers=c.min_workers,
                    max_workers=c.max_workers,
                ),
                spec.model.device,
                on_cluster=on_a_cluster(c.address),
                gpus_now=gpus_in_cluster(),
            )
            log.info(
                "worker pool: %d to %d %s worker(s)",
                plan.min_workers,
                plan.max_workers,
                "GPU" if plan.use_gpu else "CPU",
            )
            largest = max(todo, key=lambda item: item.settings.width * item.settings.height).settings
            memory_bytes, memory_estimate = worker_memory(
                spec.model,
                override=c.memory_per_worker,
                width=largest.width,
                height=largest.height,
                batch=c.max_batch,
                use_gpu=plan.use_gpu,
            )
            plan = dataclasses.replace(plan, memory_bytes=memory_bytes)
            memory_request.update(bytes=memory_bytes, estimate=memory_estimate)
            check_memory_fits(plan, on_cluster=on_a_cluster(c.address))
            config = worker_config(spec, warmup=warmup, memory_budget_bytes=None if plan.use_gpu else memory_bytes)
            config = dataclasses.replace(config, lease_holder_id=lease.record.holder_id)
            pool = WorkerPool(config, plan, renderer_factory)
            bar = _progress_bar(len(validated.items), len(validated.items) - len(todo)) if progress else None
            callbacks = [f for f in (bar.update if bar else None, on_progress) if f is not None]

            def done(outcome: ItemOutcome, item: WorkItem) -> None:
                images_per_node[outcome.row.get("node_id") or "?"] += 1
                forward_batches[outcome.row.get("forward_batch") or 0] += 1
                if outcome.memory is not None:
                    memory_by_worker[outcome.row["worker_id"]] = outcome.memory
                if outcome.row.get("skipped_forwards") is not None:
                    step_cache["images"] += 1
                    step_cache["forwards_saved"] += outcome.row["skipped_forwards"]
                    step_cache["forwards"] += outcome.row["steps"]
                _commit(metadata, storage, spec, outcome)

            scheduler = BatchScheduler(
                [],
                [],
                SchedulerConfig(
                    c.max_in_flight_per_worker,
                    c.max_attempts,
                    c.max_batch,
                    transfer_bytes_per_s=c.transfer_gbps * 1e9 / 8 if c.transfer_gbps else None,
                    start_timeout_s=c.start_timeout_s,
                    max_requeues_per_item=c.max_requeues_per_item,
                ),
                on_done=done,
                on_failed=lambda outcome, item, attempt: _record_failure(errors, outcome, item, attempt),
                on_progress=(lambda n: [f(n) for f in callbacks]) if callbacks else None,
                pool=pool,
                on_worker=(lambda handle, info: on_workers([handle], [info])) if on_workers else None,
                on_event=on_event,
            )
            t_schedule = time.time()
            try:
                stats = scheduler.run(todo)
            finally:
                # Start-up ends when min_workers are ready (inside run); rendering is the rest.
                waited = scheduler.stats.seconds_to_start
                timing["startup_seconds"] = t_schedule - t_start + waited
                timing["render_seconds"] = time.time() - t_schedule - waited
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: committing what is done; run the same spec again to resume")
        raise
    finally:
        _release(scheduler, pool)
        if stats is None and scheduler is not None:
            stats = scheduler.stats  # interrupted or failed: count what was done
        metadata.close()
        errors.close()
        if bar:
            bar.close()
        summary = _summary(
            spec,
            fingerprint,
            validated,
            done_before,
            todo,
            stats,
            t_start,
            interrupted,
            timing,
            scheduler.encodes_by_reference if scheduler else None,
            images_per_node,
            forward_batches,
            memory_by_worker,
            memory_request,
            step_cache,
        )
        write_summary(storage, summary)
        lease.release()
    if write_gallery:
        from snapref_ray.report import write_report

        try:
            write_report(spec.output.uri, s3)
        except Exception as e:  # a report must never fail a finished job
            log.warning("could not write the gallery: %s", e)
    log.info(
        "done: %s",
        json.dumps({k: summary[k] for k in ("images_total", "images_this_run", "failed_items", "images_per_hour")}),
    )
    return summary


def _recorded_validation_errors(storage) -> set[tuple]:
    table = read_errors_table(storage, exclude_ids=set())
    rows = table.select(["manifest_row", "item_id", "error", "stage"]).to_pylist()
    return {(r["manifest_row"], r["item_id"], r["error"]) for r in rows if r["stage"] == "validate"}


def _release(scheduler: BatchScheduler | None, pool: WorkerPool | None) -> None:
    """Kill the job's workers (their models and device caches) and the actors still starting now,
    rather than when the handles are garbage-collected: a driver that runs several jobs, or was
    interrupted, must not keep them, and the autoscaler can only remove idle nodes."""
    if pool is not None:
        pool.cancel_starting()
    for worker in scheduler.workers if scheduler else []:
        if not worker.released:
            kill(worker.handle)


def _commit(metadata: MetadataWriter, storage, spec: JobSpec, outcome: ItemOutcome) -> None:
    if outcome.row.get("shard_key"):
        return  # committed by its worker, with its shard (storage/shards.py)
    image_bytes = storage.get_bytes(outcome.row["image_key"]) if spec.output.embed_images else None
    metadata.add(outcome.row, image_bytes)


def _record_failure(errors: ErrorWriter, outcome: ItemOutcome, item: WorkItem, attempt: int) -> None:
    log.error(
        "item %s (manifest row %d) failed after %d attempt(s): %s",
        item.item_id,
        item.manifest_row,
        attempt,
        outcome.error,
    )
    job_metrics().errors.inc(1, {"stage": _STAGES.get(outcome.stage, outcome.stage)})
    errors.record(
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


def _summary(
    spec,
    fingerprint,
    validated,
    done_before,
    todo,
    stats,
    t_start,
    interrupted,
    timing,
    encodes_by_reference,
    images_per_node,
    forward_batches,
    memory_by_worker,
    memory_request,
    step_cache,
) -> dict:
    wall = time.time() - t_start
    done_now = stats.done_items if stats else 0
    references = len({item.reference_hash for item in todo})
    # Reference-stream runs the workers reported (not the driver's requests): a worker that had
    # to re-encode (evicted, restarted) shows here.
    encodes = stats.reference_encodes if stats else 0
    render_s = timing["render_seconds"]
    return {
        "manifest": spec.manifest,
        "output": spec.output.uri,
        "config_hash": fingerprint,
        "manifest_rows": validated.rows,
        "invalid_rows": len(validated.errors),
        "items": len(validated.items),
        "images_total": len(done_before & {i.item_id for i in validated.items}) + done_now,
        "images_this_run": done_now,
        "skipped_already_done": len(validated.items) - len(todo),
        "failed_items": stats.failed_items if stats else 0,
        # An attempt is an item's own failure (an error raised rendering it); work the cluster lost is requeued
        # without one, counted by cause under `requeues` (cluster/failures.py).
        "attempts": {
            "max_attempts": spec.cluster.max_attempts,
            "charged": stats.attempts_charged if stats else 0,
            "retried_items": stats.retried_items if stats else 0,
            "failed_items": stats.failed_items if stats else 0,
        },
        "requeues": {
            **(dict(stats.requeues) if stats else dict.fromkeys(REQUEUE_CAUSES, 0)),
            "budget": stats.requeue_budget if stats else 0,
        },
        "interrupted": interrupted,
        "wall_seconds": round(wall, 3),
        "images_per_hour": round(3600 * done_now / wall, 1) if wall > 0 else 0.0,
        "startup_seconds": round(timing["startup_seconds"], 3),
        "render_seconds": round(render_s, 3),
        "images_per_hour_rendering": round(3600 * done_now / render_s, 1) if render_s > 0 else 0.0,
        "references": references,
        "reference_encodes": encodes,
        "encodes_per_reference": round(encodes / references, 3) if references else 0.0,
        "max_encodes_per_reference": max(encodes_by_reference.values(), default=0) if encodes_by_reference else 0,
        "images_per_node": dict(sorted(images_per_node.items())),
        "peak_workers": stats.peak_workers if stats else 0,
        # Images by the size of the forward that rendered them: the batch the workers chose (on a GPU, the
        # largest that fits the resolution, capped by max_batch; see service/memory.py).
        "forward_batches": {str(k): v for k, v in sorted(forward_batches.items())},
        # Per worker and resolution: one image's peak, what each further image adds, the batch chosen.
        # DiT forwards the step cache let images skip (each image's rows skip or run together): of the
        # forwards the images with the cache on would have run, how many they did not.
        "step_cache": step_cache if step_cache["images"] else None,
        # The host memory each worker asked Ray for (cluster.memory_per_worker, or the estimate's figures).
        "memory_per_worker": memory_request or None,
        "memory_fit": [
            {"worker_id": worker, **limit} for worker, limits in sorted(memory_by_worker.items()) for limit in limits
        ],
        # The batch cap per (width, height, rows per image): max_batch, or less where a batch ran out of memory
        # and was halved (out_of_memory_splits times).
        "batch_limits": stats.batch_limits if stats else [],
        # How RefKVs reached the workers that did not encode them (see cluster/scheduler.py).
        "refkv_decisions": {
            "same_node_fetches": stats.same_node_fetches if stats else 0,
            "cross_node_fetches": stats.cross_node_fetches if stats else 0,
            "cross_node_reencodes": stats.local_encodes if stats else 0,
            "transfer_gbps": _gbps(stats, spec),
        },
        "scheduler": asdict(stats) if stats else None,
        "finished_at": time.time(),
    }


def _gbps(stats, spec) -> dict:
    measured = stats.measured_transfer_bytes_per_s if stats else None
    return {"configured": spec.cluster.transfer_gbps, "measured": round(8 * measured / 1e9, 3) if measured else None}


JOB_USAGE = """`ray job submit --working-dir . -- python -m jobs.generate_dataset SPEC.yaml`

Runs a dataset-generation job spec on the cluster the job was submitted to (RAY_ADDRESS is
set by `ray job submit`); resubmitting the same spec resumes it.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=JOB_USAGE)
    parser.add_argument("spec", help="job spec YAML (local or s3://)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def job() -> int:
        summary = run_job(load_job_spec(args.spec), progress=not args.no_progress)
        return 1 if summary["failed_items"] else 0

    return run_reporting_usage_errors(job)
