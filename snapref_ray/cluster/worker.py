"""The batch worker: a Ray actor per GPU that owns one `RenderService` and stores what it renders.

What lies between a request and an image (the model, the RefKV cache, settings, the memory fit) is the
render service's (snapref_ray/render_service/). What is the job's own lives here: the RefKV it encodes is
returned to the driver (owned by the caller, so it outlives the worker) and other workers fetch it
from the object store; the images go to the job's output (images/, thumbs/, references/) and each
becomes a metadata row the driver commits. Storing overlaps the next batch's sampling: the actor runs
two calls at once (`max_concurrency=2`), the service keeps the device to one of them, and the images go
to an `OutputWriter`'s threads once the forward is done (output_writer.py).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from snapref_ray.cluster.failures import LOST_REFKV_ERRORS
from snapref_ray.cluster.metrics import job_metrics
from snapref_ray.cluster.output_writer import OutputWriter
from snapref_ray.cluster.tasks import EncodeInfo, ItemOutcome, ReferenceTask, RenderTask, ShardReport, WorkerInfo
from snapref_ray.model_spec import ModelSpec
from snapref_ray.render_service.judges.call import JudgeCall
from snapref_ray.render_service.judges.spec import JudgeSpec
from snapref_ray.render_service.memory import RenderOutOfMemory
from snapref_ray.render_service.records import describe_error, encode_output, image_extension, metadata_row
from snapref_ray.render_service.references import Reference, RefKVKey
from snapref_ray.render_service.refkv_cache import DEFAULT_REFKV_CACHE_BYTES
from snapref_ray.storage.backends import S3Options, open_storage, read_uri
from snapref_ray.storage.image_files import make_thumbnail
from snapref_ray.storage.metadata import image_key, reference_image_key, thumb_key
from snapref_ray.storage.shards import ShardWriter, remove_dead_workers_temporaries, wants_thumbnail

if TYPE_CHECKING:
    from snapref_ray.render_service.service import RefKV

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs to build its render service and write outputs (picklable)."""

    model: ModelSpec
    refkv_cache_bytes: int = DEFAULT_REFKV_CACHE_BYTES
    output_uri: str = "./output"
    s3: S3Options | None = None
    image_format: str = "png"
    warmup: bool = True
    model_cache_dir: str | None = None
    warmup_sizes: tuple[tuple[int, int], ...] = ()  # (width, height) graphs compiled at start when compiling
    # Images per forward the plan will run (max_batch and its tail batch): warmed with each size when compiling.
    warmup_batch_sizes: tuple[int, ...] = ()
    output_threads: int = 4  # encode/upload threads (output_writer.py); 0 = store inline, the device waits
    memory_budget_bytes: int | None = None  # the memory= this worker asked Ray for (render_service/memory.py)
    # Longest wait for a RefKV from the object store before encoding the reference here instead: a lost RefKV
    # is rebuilt through its creating actor (a node boot and a model load away), an encode is one forward.
    refkv_fetch_timeout_s: float = 30.0
    # output.format: "files" (an object per image) or "webdataset" (tar shards per worker, storage/shards.py).
    output_format: str = "files"
    shard_max_bytes: int = 1_000_000_000
    shard_max_items: int = 10_000
    thumbnail_every: int = 1000  # webdataset: a thumbnail for about one item in this many
    # A judged job's checks (job spec `judge:`): every render is scored here, right after its decode; the driver
    # re-decides near_duplicate against the reference's kept set (jobs/judge_loop.py).
    judge: JudgeSpec | None = None
    # The identity gap's contrast references: the job's first two (their tasks); a render takes the first that is
    # not its own reference (docs/judging.md, "In a batch job").
    judge_contrasts: tuple[ReferenceTask, ...] = ()
    job: str | None = None  # the job's fingerprint, in every metadata row (an appended output holds several jobs)


def load_worker_renderer(config: WorkerConfig):
    """The real model of a worker (`renderer_factory` replaces it in benchmarks and tests)."""
    from snapref_ray.render_service.loading import load_renderer

    return load_renderer(config.model, s3=config.s3, cache_dir=config.model_cache_dir)


class RenderWorker:
    """Owns a RenderService on one device; see the module docstring."""

    def __init__(self, config: WorkerConfig, renderer_factory: Callable[[WorkerConfig], object] | None = None) -> None:
        import ray

        # The service (torch, the model code) is imported here, in the worker's process: the driver imports this
        # module to create the actor, and plans and schedules without torch.
        from snapref_ray.render_service.service import RenderService

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.config = config
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.worker_id = f"{self.node_id[:8]}-{os.getpid()}"
        renderer = (renderer_factory or load_worker_renderer)(config)
        self.service = RenderService(
            renderer,
            refkv_cache_bytes=config.refkv_cache_bytes,
            memory_budget_bytes=config.memory_budget_bytes,
            model_spec=config.model,
        )
        self.storage = open_storage(config.output_uri, config.s3)
        self.writer = OutputWriter(config.output_threads)
        self.shards = (
            ShardWriter(
                self.storage, name=self.worker_id, max_bytes=config.shard_max_bytes, max_items=config.shard_max_items
            )
            if config.output_format == "webdataset"
            else None
        )
        if self.shards is not None:
            remove_dead_workers_temporaries()  # temporary tars of workers killed on this node
        self._stored_references: set[str] = set()
        self._contrasts: dict[str, Reference] = {}  # the contrast references, read once
        self.metrics = job_metrics()
        self.tags = {"worker": self.worker_id}
        if config.warmup:
            self._warm_up()

    def _warm_up(self) -> None:
        """One small step so that the first real batch does not pay for kernel selection and allocation."""
        t0 = time.perf_counter()
        if self.config.model.compile and self.config.warmup_sizes:
            # A compiling worker builds (or loads from the compile cache) the graphs of its job's sizes and
            # batch sizes now, with a reference read when an adapter is loaded (render_service/cold_start.py).
            self.service.warmup(self.config.warmup_sizes, self.config.warmup_batch_sizes or (1,))
        else:
            self.service.warm_up_image()
        log.info("worker %s warmed up in %.2f s", self.worker_id, time.perf_counter() - t0)

    # -- called by the driver ------------------------------------------------------------------
    def info(self) -> WorkerInfo:
        described = self.service.device_description()
        return WorkerInfo(
            self.worker_id,
            self.node_id,
            described.device,
            os.getpid(),
            described.load_seconds,
            self.config.memory_budget_bytes,
            cold_start=self.service.cold_start().as_dict(),
        )

    def pid(self) -> int:
        return os.getpid()

    def cold_start(self) -> dict:
        """The cold start so far (`WorkerInfo.cold_start` is the same at ready time): load, compile, warm-up,
        first image seconds (render_service/cold_start.py)."""
        return self.service.cold_start().as_dict()

    def batch_limits(self) -> list[dict]:
        """The batch this worker chose per resolution, and the memory figures behind it."""
        return self.service.memory.report()

    def encode(self, task: ReferenceTask) -> tuple[RefKV, EncodeInfo]:
        """Encode a reference; called with `num_returns=2` (see `BatchScheduler`).

        The RefKV return goes to the object store, owned by the caller, so it outlives this
        worker; the small EncodeInfo return is what the driver waits on (never the RefKV, which
        would be pulled to the driver's node). The RefKV also stays in this worker's device cache.
        """
        kv, source = self.service.refkv(self._reference(task))
        if source == "encoded":
            self.metrics.encodes.inc(1, self.tags)
        return kv, EncodeInfo(task.reference_hash, kv.nbytes, kv.encode_seconds, self.worker_id, source == "encoded")

    def publish_outputs(self) -> ShardReport | None:
        """Stage the open webdataset shard (the driver calls this before it releases the worker, and commits what
        it staged); the shards closed since the last answer, this one included (None without shards). Raises when
        staging fails."""
        if self.shards is None:
            return None
        self.shards.close()
        return self._shard_report()

    def render(self, task: RenderTask, refkv_handle: list | None = None) -> list[ItemOutcome]:
        """Render a batch and store its images; returns one outcome per item, the first with the shards closed
        since the last answer (webdataset: the driver commits a staged shard and counts its items done then).

        `refkv_handle` is `[ObjectRef]` (wrapped so Ray does not fetch it eagerly): it is only
        read when the RefKV is not already in this worker's device cache.
        """
        outcomes = self._render(task, refkv_handle)
        if self.shards is not None and outcomes:
            outcomes[0] = replace(outcomes[0], shards=self._shard_report())
        return outcomes

    def _shard_report(self) -> ShardReport:
        return ShardReport(self.worker_id, tuple(self.shards.drain()))

    def _render(self, task: RenderTask, refkv_handle: list | None) -> list[ItemOutcome]:
        started = time.time()
        fetch_s, lost = [0.0], [""]
        ref = task.reference
        fetch = (lambda: self._fetch(ref, refkv_handle, fetch_s, lost)) if refkv_handle else None
        reference = self._reference(ref, fetch)
        try:  # the service decides what the batch reads: the images (recompute_reference_every_step) or a RefKV
            read = self.service.read_reference(reference, task.items[0].settings)
        except Exception as e:  # an unreadable reference fails its items, not the worker
            return self._failed(task, e, "encode")
        source = {"fetched": "object_store"}.get(read.source, read.source)
        if source == "encoded":
            self.metrics.encodes.inc(1, self.tags)
        if source != "recomputed":
            (self.metrics.cache_hits if source == "cache" else self.metrics.cache_misses).inc(1, self.tags)
        try:
            rendered = self.service.render(
                [item.request() for item in task.items],
                reference=read,
                progress=self.service.tick,
                judge=self._judge_call(ref),
            )
        except RenderOutOfMemory as e:  # one image that does not fit: the service already split the batch
            return self._failed(task, e, "sample", source, out_of_memory=True)
        except Exception as e:
            return self._failed(task, e, "sample", source)
        stores = self.writer.submit_all(
            [functools.partial(self._store, task, item, out, started) for item, out in zip(task.items, rendered)]
        )
        steps = max(1, task.items[0].settings.steps)
        self.metrics.step_latency.observe(rendered[0].timings.get("sample_s", 0.0) / steps, self.tags)
        outcomes = []
        for item, stored in zip(task.items, stores):
            try:
                outcomes.append(
                    replace(stored.result(), refkv_source=source, fetch_seconds=fetch_s[0], refkv_lost=lost[0])
                )
                self.metrics.images.inc(1, self.tags)
                self.metrics.image_latency.observe(time.time() - started, self.tags)
            except Exception as e:
                outcomes.append(ItemOutcome(item.item_id, error=describe_error(e), stage="write", refkv_source=source))
        if outcomes:
            outcomes[0] = replace(outcomes[0], memory=self.service.memory.report())
        return outcomes

    # -- internals -------------------------------------------------------------------------------
    def _reference(self, ref: ReferenceTask, fetch: Callable[[], RefKV | None] | None = None) -> Reference:
        """The job's reference task as the one carrier the render service takes (its files read from the job's
        storage when the service needs them; `fetch` a copy of its RefKV another worker encoded)."""
        return Reference(ref.key, ref.layout, ref.uris, lambda: self._read_images(ref), fetch=fetch)

    def _judge_call(self, ref: ReferenceTask) -> JudgeCall | None:
        """What this job's renders are judged by; no kept set (the driver holds it and re-decides near_duplicate)."""
        spec = self.config.judge
        if spec is None:
            return None
        if spec.identity_gap is None:
            return JudgeCall(spec)
        other = next((c for c in self.config.judge_contrasts if c.reference_hash != ref.reference_hash), None)
        if other is None:
            return JudgeCall(spec)  # the service refuses it, naming judge.identity_gap.contrast_reference
        contrast = self._contrasts.get(other.reference_hash)
        if contrast is None:
            from snapref_ray.requests import RenderSettings

            images = self._read_images(other)
            contrast = Reference.of_images(images, other.layout, RenderSettings(), other.uris)
            self._contrasts[other.reference_hash] = contrast
        return JudgeCall(spec, contrast=contrast)

    def _read_images(self, ref: ReferenceTask) -> list[bytes]:
        return [read_uri(uri, self.config.s3) for uri in ref.uris]

    def _fetch(self, ref: ReferenceTask, handle: list, fetch_s: list[float], lost: list[str]) -> RefKV | None:
        """The driver's copy of the RefKV from the object store; None (and `lost` says why) when it is gone or
        not to be had in time: lost with its node, its owner or creating actor dead, timed out (failures.py)."""
        import ray

        try:
            # The driver hands out only finished RefKVs, so this never waits on an encode
            # queued behind this very call (a deadlock with max_concurrency=2).
            t0 = time.perf_counter()
            shared = ray.get(handle[0], timeout=self.config.refkv_fetch_timeout_s)
            fetch_s[0] = time.perf_counter() - t0
        except LOST_REFKV_ERRORS as e:  # gone, or not to be had in time: encode it here
            lost[0] = type(e).__name__
            log.warning(
                "worker %s: RefKV of %s cannot be fetched (%s); re-encoding",
                self.worker_id,
                ref.reference_hash[:12],
                lost[0],
            )
            return None
        return self.service.private_refkv(shared)  # the store's copy would stay pinned by the LRU

    def _store(self, task: RenderTask, item, rendered, started: float) -> ItemOutcome:
        t0 = time.perf_counter()
        fmt = self.config.image_format
        service = self.service
        image = encode_output(
            rendered, model=service.model_id, adapter=service.adapter_id, item_id=item.item_id, fmt=fmt
        )
        key, thumb = image_key(item.item_id, image_extension(fmt)), thumb_key(item.item_id)
        if self.shards is not None:  # the image goes into the shard (below); a thumbnail only for a sample
            key = None
            thumb = thumb if wants_thumbnail(item.item_id, self.config.thumbnail_every) else None
        else:
            self.storage.put_bytes(key, image)
        if thumb is not None:
            self.storage.put_bytes(thumb, make_thumbnail(rendered.image))
        # The gallery's copy of the reference: for every item with one file per image; with shards, only for the
        # sampled items the gallery draws (one object per reference would outnumber the shards many times over).
        reference_key = self._store_reference(task.reference) if self.shards is None or thumb else None
        row = metadata_row(
            rendered,
            item_id=item.item_id,
            reference_uris=list(item.reference.uris),
            model=service.model_id,
            adapter=service.adapter_id,
            worker_id=self.worker_id,
            node_id=self.node_id,
            image_format=fmt,
            started_at=started,
            manifest_row=item.manifest_row,
            reference_image_key=reference_key,
            image_key=key,
            image_uri=self.storage.uri_for(key) if key else None,
            thumb_key=thumb,
            upload_s=time.perf_counter() - t0,
            attempt=task.attempts.get(item.item_id, 1),
            job=self.config.job,
            **(
                {"render_of": item.render_of or item.item_id, "render_index": item.render_index}
                if self.config.judge is not None
                else {}
            ),
        )
        if self.shards is not None:  # staged with its shard; the driver commits the shard
            row = self.shards.add(row, image, image_extension(fmt), item.prompt)
        return ItemOutcome(item.item_id, row=row)

    def _store_reference(self, ref: ReferenceTask) -> str:
        """A small copy of the reference for the gallery, written once per worker and reference."""
        key = reference_image_key(ref.reference_hash)
        if ref.reference_hash in self._stored_references:
            return key
        if not self.storage.exists(key):
            picture = self.service.reference_picture(self._reference(ref))
            self.storage.put_bytes(key, make_thumbnail(picture, max_side=512))
        self._stored_references.add(ref.reference_hash)
        return key

    def _failed(
        self, task: RenderTask, error: Exception, stage: str, source: str = "", *, out_of_memory: bool = False
    ) -> list[ItemOutcome]:
        message = str(error) if out_of_memory else describe_error(error)
        log.error(
            "worker %s: %s failed for %d item(s) (%s): %s",
            self.worker_id,
            stage,
            len(task.items),
            ", ".join(i.item_id for i in task.items[:4]),
            message,
        )
        self.metrics.errors.inc(len(task.items), {"stage": stage})
        return [
            ItemOutcome(i.item_id, error=message, stage=stage, refkv_source=source, out_of_memory=out_of_memory)
            for i in task.items
        ]

    def evaluate(self, case: dict) -> dict:
        """Identity-gap loss grids of one held-out case (`snapref_ray/jobs/identity_eval.py` builds `case`).

        The right and the wrong reference go through this worker's RefKV cache, so each is
        encoded once per worker and target size however many cases and σ/seed draws use it; both
        grids share the case's σ values and noise seeds (`RenderService.identity_gap_losses`).
        A failure is returned as {"case_id", "error"}: one bad image must not stop the evaluation.
        """
        from snapref_ray.evaluation import prepare_target

        t0 = time.perf_counter()
        service = self.service
        try:
            target = prepare_target(read_uri(case["target"], self.config.s3), case["target_megapixels"], case["target"])
            right, wrong = (
                self._reference(
                    ReferenceTask(
                        case[f"{role}_hash"],
                        tuple(case[f"{role}_uris"]),
                        case.get("layout", "single"),
                        RefKVKey.for_size(
                            case[f"{role}_hash"],
                            case["ref_caption"],
                            case["ref_megapixels"],
                            width=target.width,
                            height=target.height,
                        ),
                    )
                )
                for role in ("right", "wrong")
            )
            losses = service.identity_gap_losses(
                target,
                case["prompt"],
                right,
                wrong,
                case["sigmas"],
                case["noise_seeds"],
                mode=case["mode"],
                ref_weight=case["ref_weight"],
            )
        except Exception as e:
            log.error("worker %s: case %s failed: %s", self.worker_id, case.get("case_id"), describe_error(e))
            return {"case_id": case.get("case_id"), "error": describe_error(e)}
        described = service.device_description()
        return {
            "case_id": case["case_id"],
            "loss_right": losses.loss_right,
            "loss_wrong": losses.loss_wrong,
            "width": target.width,
            "height": target.height,
            "right_cache_hit": losses.right_cache_hit,
            "wrong_cache_hit": losses.wrong_cache_hit,
            "seconds": time.perf_counter() - t0,
            "worker_id": self.worker_id,
            "model": service.model_id,
            "adapter": service.adapter_id,
            "adapter_kind": service.adapter_kind,
            "device": described.device,
            "dtype": described.dtype,
        }
