"""The job spec read once, at the top of a run, into what each part of the run needs.

vLLM's `EngineArgs` is the shape: one user-facing object, turned once into narrow typed configs, one per consumer.
Here the planner (validation and spilling: jobs/manifest_check.py `ManifestSettings`), the output
(storage/job_output.py `OutputSettings`, with where it is), the pool, the schedule and the workers each get their own
few values, never the `JobSpec`: what a part depends on is what its signature says, and the values derived from the
spec (the job's fingerprint, the S3 settings) are computed in one place, once per run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from snapref_ray.cluster.scheduler_config import SchedulerConfig
from snapref_ray.job_spec import JobSpec, JudgeSection, spec_fingerprint
from snapref_ray.jobs.manifest_check import ManifestSettings
from snapref_ray.model_spec import ModelSpec
from snapref_ray.storage.backends import S3Options
from snapref_ray.storage.job_output import OutputSettings
from snapref_ray.storage.ledger import job_fingerprint

if TYPE_CHECKING:  # their modules import Ray, which a dry run (OutputPlace alone) does without
    from snapref_ray.cluster.pool import PoolShape
    from snapref_ray.cluster.worker import WorkerConfig


@dataclass(frozen=True)
class OutputPlace:
    """The output as a run takes it: where, with which S3 settings, and what the job says about it."""

    uri: str
    s3: S3Options
    settings: OutputSettings  # what storage/ needs (the fingerprint, the lease, the format)
    rerender_changed: bool = False  # explicit ids committed with other content are rendered again, not refused

    @classmethod
    def of(cls, spec: JobSpec, *, s3: S3Options) -> OutputPlace:
        """The spec's output section, with the job's fingerprint (computed here, once per run)."""
        recorded = spec_fingerprint(spec)
        out = spec.output
        return cls(
            uri=out.uri,
            s3=s3,
            settings=OutputSettings(
                fingerprint=job_fingerprint(recorded),
                spec=recorded,
                append=out.append,
                webdataset=out.format == "webdataset",
                embed_images=out.embed_images,
                flush_seconds=out.metadata_flush_seconds,
                lease_seconds=out.lease_seconds,
                lease_wait_seconds=out.lease_wait_seconds,
            ),
            rerender_changed=out.rerender_changed,
        )

    @property
    def fingerprint(self) -> str:
        return self.settings.fingerprint


@dataclass(frozen=True)
class PoolSettings:
    """What sizing and starting the worker pool needs (cluster/pool.py)."""

    address: str | None  # the Ray cluster to join (None: RAY_ADDRESS, or a local Ray)
    shape: PoolShape
    device: str  # the model's device: "cpu" makes CPU workers
    memory_per_worker: int | None  # bytes each worker asks Ray for; None: estimated from the model files
    max_batch: int  # the largest forward: the memory estimate is made at it


@dataclass(frozen=True)
class JobSettings:
    """A job spec, read into what each part of a run needs (see the module docstring)."""

    manifest: ManifestSettings
    output: OutputPlace
    pool: PoolSettings
    scheduler: SchedulerConfig
    # The workers' configuration but what the plan decides (warm-up sizes, contrast references, memory budget).
    worker: WorkerConfig
    judge: JudgeSection | None  # a judged job's checks and loop (jobs/judge_loop.py); None: every render is kept
    max_attempts: int  # attempts per item (reported in summary.json)
    transfer_gbps: float | None  # the configured cross-node rate (reported beside the measured one)

    @property
    def model(self) -> ModelSpec:
        return self.worker.model

    @classmethod
    def of(cls, spec: JobSpec) -> JobSettings:
        """Read `spec` once: the job's fingerprint, its S3 settings and each consumer's settings."""
        from snapref_ray.cluster.pool import PoolShape
        from snapref_ray.cluster.worker import WorkerConfig

        s3 = spec.s3_options()
        output = OutputPlace.of(spec, s3=s3)
        c, out = spec.cluster, spec.output
        worker = WorkerConfig(
            model=spec.model,
            refkv_cache_bytes=c.refkv_cache_bytes,
            output_uri=out.uri,
            s3=s3,
            image_format=out.image_format,
            output_threads=c.output_threads,
            warmup_sizes=((spec.defaults.width, spec.defaults.height),),  # the plan's sizes, once it has any
            warmup_batch_sizes=(1,),
            refkv_fetch_timeout_s=c.refkv_fetch_timeout_s,
            output_format=out.format,
            shard_max_bytes=out.shard_max_bytes,
            shard_max_items=out.shard_max_items,
            thumbnail_every=out.thumbnail_every,
            judge=spec.judge.checks_spec() if spec.judge is not None else None,
            job=output.fingerprint,  # each metadata row names its job (an output may hold several)
        )
        return cls(
            manifest=ManifestSettings.of(spec, s3=s3),
            output=output,
            pool=PoolSettings(
                address=c.address,
                shape=PoolShape(
                    c.num_workers,
                    c.cpu_workers,
                    c.num_cpus_per_worker,
                    min_workers=c.min_workers,
                    max_workers=c.max_workers,
                ),
                device=spec.model.device,
                memory_per_worker=c.memory_per_worker,
                max_batch=c.max_batch,
            ),
            scheduler=SchedulerConfig(
                c.max_in_flight_per_worker,
                c.max_attempts,
                c.max_batch,
                transfer_bytes_per_s=c.transfer_gbps * 1e9 / 8 if c.transfer_gbps else None,
                start_timeout_s=c.start_timeout_s,
                max_requeues_per_item=c.max_requeues_per_item,
            ),
            worker=worker,
            judge=spec.judge,
            max_attempts=c.max_attempts,
            transfer_gbps=c.transfer_gbps,
        )
