"""Dataset generation: a job spec in, images + Parquet metadata + errors + summary + gallery out.

validate every row -> claim the output (same spec, or append) -> skip committed items ->
workers render with reference affinity -> rows committed as images land -> summary, gallery.
Interrupting (Ctrl-C, a killed driver) loses nothing committed; running the same spec again
renders only what is missing.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict

from snapref_ray.cluster.metrics import job_metrics
from snapref_ray.cluster.pool import PoolShape, connect, start_workers
from snapref_ray.cluster.scheduler import BatchScheduler, SchedulerConfig
from snapref_ray.cluster.tasks import ItemOutcome
from snapref_ray.cluster.worker import WorkerConfig
from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.jobspec import JobSpec, spec_fingerprint
from snapref_ray.storage.ledger import claim_output, committed_item_ids, job_fingerprint
from snapref_ray.storage.metadata import ErrorWriter, MetadataWriter, write_summary
from snapref_ray.storage.work_items import JobValidationError, WorkItem, load_work_items

log = logging.getLogger(__name__)

_STAGES = {"worker": "sample"}  # a worker death is reported against the sampling stage


def worker_config(spec: JobSpec, *, warmup: bool = True) -> WorkerConfig:
    c = spec.cluster
    return WorkerConfig(models=spec.models.model_dump(), adapter=spec.adapter,
                        loras=tuple((lora.path, lora.strength) for lora in spec.loras), device=c.device,
                        dtype=c.dtype, refkv_cache_bytes=c.refkv_cache_bytes, output_uri=spec.output.uri,
                        s3=spec.s3_options(), image_format=spec.output.image_format, warmup=warmup)


def run_job(spec: JobSpec, *, progress: bool = True, renderer_factory: Callable | None = None,
            warmup: bool = True, write_gallery: bool = True) -> dict:
    """Run (or resume) a batch job; returns the summary that is also written to summary.json."""
    t_start = time.time()
    s3 = spec.s3_options()
    storage = open_storage(spec.output.uri, s3)
    validated = load_work_items(spec, s3)
    if validated.errors and spec.strict:
        raise JobValidationError(spec.manifest, validated.errors)
    fingerprint = job_fingerprint(spec_fingerprint(spec))
    claim_output(storage, fingerprint, spec_fingerprint(spec), append=spec.output.append)

    done_before = committed_item_ids(storage)
    todo = [item for item in validated.items if item.item_id not in done_before]
    log.info("%d manifest rows -> %d items (%d invalid rows); %d already committed, %d to render",
             validated.rows, len(validated.items), len(validated.errors), len(validated.items) - len(todo), len(todo))

    metadata = MetadataWriter(storage, embed_images=spec.output.embed_images)
    errors = ErrorWriter(storage)
    for e in validated.errors:
        errors.record(f"{'field ' + repr(e.field) + ': ' if e.field else ''}{e.error}", "validate",
                      item_id=e.item_id, manifest_row=e.manifest_row)

    stats = None
    bar = _progress_bar(len(validated.items), len(validated.items) - len(todo)) if progress else None
    interrupted = False
    try:
        if todo:
            connect(spec.cluster.address)
            shape = PoolShape(spec.cluster.num_workers, spec.cluster.cpu_workers, spec.cluster.num_cpus_per_worker)
            workers, infos = start_workers(worker_config(spec, warmup=warmup), shape, renderer_factory)
            scheduler = BatchScheduler(
                workers, infos, SchedulerConfig(spec.cluster.max_in_flight_per_worker, spec.cluster.max_attempts,
                                                spec.cluster.max_batch),
                on_done=lambda outcome, item: _commit(metadata, storage, spec, outcome),
                on_failed=lambda outcome, item, attempt: _record_failure(errors, outcome, item, attempt),
                on_progress=(bar.update if bar else None))
            stats = scheduler.run(todo)
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: committing what is done; run the same spec again to resume")
        raise
    finally:
        metadata.close()
        errors.close()
        if bar:
            bar.close()
        summary = _summary(spec, fingerprint, validated, done_before, todo, stats, t_start, interrupted)
        write_summary(storage, summary)
    if write_gallery:
        from snapref_ray.report import write_report

        try:
            write_report(spec.output.uri, s3)
        except Exception as e:  # a report must never fail a finished job
            log.warning("could not write the gallery: %s", e)
    log.info("done: %s", json.dumps({k: summary[k] for k in ("images_total", "images_this_run", "failed_items",
                                                              "images_per_hour")}))
    return summary


def _commit(metadata: MetadataWriter, storage, spec: JobSpec, outcome: ItemOutcome) -> None:
    image_bytes = storage.get_bytes(outcome.row["image_key"]) if spec.output.embed_images else None
    metadata.add(outcome.row, image_bytes)


def _record_failure(errors: ErrorWriter, outcome: ItemOutcome, item: WorkItem, attempt: int) -> None:
    log.error("item %s (manifest row %d) failed after %d attempt(s): %s", item.item_id, item.manifest_row,
              attempt, outcome.error)
    job_metrics().errors.inc(1, {"stage": _STAGES.get(outcome.stage, outcome.stage)})
    errors.record(outcome.error or "unknown error", _STAGES.get(outcome.stage, outcome.stage),
                  item_id=item.item_id, manifest_row=item.manifest_row, attempt=attempt)


def _progress_bar(total: int, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="images", unit="img", smoothing=0.1,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]")


def _summary(spec, fingerprint, validated, done_before, todo, stats, t_start, interrupted) -> dict:
    wall = time.time() - t_start
    done_now = stats.done_items if stats else 0
    references = len({item.reference_hash for item in todo})
    encodes = (stats.encodes_requested + stats.local_encodes) if stats else 0
    return {
        "manifest": spec.manifest, "output": spec.output.uri, "config_hash": fingerprint,
        "manifest_rows": validated.rows, "invalid_rows": len(validated.errors), "items": len(validated.items),
        "images_total": len(done_before & {i.item_id for i in validated.items}) + done_now,
        "images_this_run": done_now, "skipped_already_done": len(validated.items) - len(todo),
        "failed_items": stats.failed_items if stats else 0, "interrupted": interrupted,
        "wall_seconds": round(wall, 3), "images_per_hour": round(3600 * done_now / wall, 1) if wall > 0 else 0.0,
        "references": references, "reference_encodes": encodes,
        "encodes_per_reference": round(encodes / references, 3) if references else 0.0,
        "scheduler": asdict(stats) if stats else None, "finished_at": time.time(),
    }
