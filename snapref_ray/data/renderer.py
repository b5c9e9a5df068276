"""`SnapRefRenderer`: the renderer as a Ray Data callable class (``ds.map_batches(SnapRefRenderer, ...)``).

Each actor of the pool loads the models once and keeps a RefKV LRU bounded in bytes, keyed like
the job workers' (reference content, caption, size, target grid). Within a batch, rows with the
same reference and settings become one batched forward (up to `max_batch` images); across
batches the LRU is what saves encodes, and it only hits when rows of one reference reach the
same actor close together: sort or group the dataset by reference upstream. Ray Data routes
batches to actors without looking at keys, so with N actors a reference is encoded up to N times
(the job runner, `snapref-ray render`, encodes it once).

Output: one row per input row, in order; the input's own columns pass through, then
`OUTPUT_SCHEMA` (the job's metadata columns that apply, `image` PNG bytes written by the project's
one image writer, `error`/`error_stage`, and per-actor cache counters). A bad row never raises:
it comes back with `error` set and no image.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from snapref_ray.adapter.images import content_hash
from snapref_ray.adapter.refkv_cache import RefKVCache
from snapref_ray.data.rows import RowInputError, RowRequest, batch_rows, parse_row, unknown_column_hints
from snapref_ray.requests import RenderRequest
from snapref_ray.storage.backends import read_uri
from snapref_ray.storage.image_files import encode_rendered_image
from snapref_ray.storage.jobspec import ClusterSpec, LoRASpec, ModelPaths, RowDefaults, S3Spec
from snapref_ray.storage.metadata import METADATA_SCHEMA
from snapref_ray.storage.work_items import combined_reference_hash, item_id_for

log = logging.getLogger(__name__)

# The job's metadata columns that mean the same here (no manifest row, no output keys, no upload).
_METADATA_COLUMNS = (
    "item_id",
    "reference_uris",
    "reference_hash",
    "prompt",
    "negative_prompt",
    "seed",
    "width",
    "height",
    "steps",
    "cfg",
    "sampler",
    "scheduler",
    "mode",
    "ref_weight",
    "ref_guidance",
    "ref_in_uncond",
    "correction",
    "ref_start",
    "ref_end",
    "ref_caption",
    "settings_json",
    "image_format",
    "adapter",
    "model",
    "worker_id",
    "node_id",
    "encode_s",
    "sample_s",
    "decode_s",
    "started_at",
    "finished_at",
)
OUTPUT_SCHEMA = pa.schema(
    [METADATA_SCHEMA.field(name) for name in _METADATA_COLUMNS]
    + [
        pa.field("image", pa.binary()),  # PNG with the `parameters` and `snapref` chunks; null on error rows
        pa.field("error", pa.string()),  # "field 'x': ..." / "TypeName: message"; null on good rows
        pa.field("error_stage", pa.string()),  # validate | encode | sample | write, as in a job's errors table
        pa.field("refkv_cache_hit", pa.bool_()),  # the reference's RefKV was already in this actor's LRU
        pa.field("batch_id", pa.string()),  # rows rendered in one batched forward share it
        pa.field("batch_index", pa.int32()),  # position in that forward
        pa.field("batch_size", pa.int32()),
        pa.field("actor_encodes", pa.int64()),  # this actor's reference encodes so far (after this batch)
        pa.field("actor_cache_hits", pa.int64()),  # this actor's RefKV cache hits so far
    ]
)


@dataclass
class _Pending:
    """A valid row waiting for its render: where it goes in the output, and its reference."""

    index: int
    request: RowRequest
    images: list[bytes]
    reference_hash: str


class SnapRefRenderer:
    """Render rows of a Ray Dataset; pass the class (not an instance) to `Dataset.map_batches`.

    Arguments have the job spec's names and meanings: `models` is a models folder (local or
    s3://) or a mapping of `ModelPaths` fields; `adapter`, `loras` (``[{"path", "strength"}]``),
    `defaults` (any `RowDefaults` field, for columns a row leaves empty), `device` / `dtype` /
    `refkv_cache_bytes` / `max_batch` as in `cluster:`, `s3` as `output.s3` (credentials from the
    AWS environment). `references_base` resolves relative reference paths (Ray workers do not run
    in the driver's directory). `renderer_factory(WorkerConfig)` replaces the real model loader
    (benchmarks use a simulated GPU).
    """

    def __init__(
        self,
        models: str | dict,
        *,
        adapter: str | None = None,
        loras: Sequence[dict | tuple] = (),
        defaults: dict | None = None,
        device: str = "auto",
        dtype: str = "auto",
        refkv_cache_bytes: int = 8 * 2**30,
        max_batch: int = 4,
        references_base: str | None = None,
        s3: dict | None = None,
        model_cache_dir: str | None = None,
        allow_empty_prompt: bool = False,
        renderer_factory: Callable | None = None,
    ) -> None:
        from snapref_ray.cluster.worker import WorkerConfig, build_renderer

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        paths = ModelPaths.model_validate({"models_dir": models} if isinstance(models, str) else models)
        lora_specs = [
            LoRASpec.model_validate(x if isinstance(x, dict) else {"path": x[0], "strength": x[1]}) for x in loras
        ]
        shape = ClusterSpec(device=device, dtype=dtype, refkv_cache_bytes=refkv_cache_bytes, max_batch=max_batch)
        self.s3 = S3Spec.model_validate(s3 or {}).options()
        self.defaults = RowDefaults.model_validate(defaults or {})
        self.references_base = references_base
        self.allow_empty_prompt = allow_empty_prompt
        self.max_batch = shape.max_batch
        config = WorkerConfig(
            models=paths.model_dump(),
            adapter=adapter,
            loras=tuple((lora.path, lora.strength) for lora in lora_specs),
            device=shape.device,
            dtype=shape.dtype,
            refkv_cache_bytes=shape.refkv_cache_bytes,
            s3=self.s3,
            warmup=False,
            model_cache_dir=model_cache_dir,
        )
        self.renderer = (renderer_factory or build_renderer)(config)
        self.cache = RefKVCache(shape.refkv_cache_bytes)
        self.node_id, self.worker_id = _identity()
        self.model_id = str(getattr(self.renderer, "model_id", ""))
        bound = getattr(self.renderer, "adapter", None)
        self.adapter_id = getattr(bound, "identity", None)
        if self.adapter_id is None and renderer_factory is None:
            # Every row has a reference: without an adapter each would fail; say so once, at start.
            raise ValueError("no SnapRef adapter loaded: pass adapter= or put adapter.safetensors in the models folder")
        self._lock = threading.Lock()  # one batch on the device at a time, whatever the pool's concurrency
        self._batches = 0
        self._hinted: set[str] = set()

    # -- the map_batches entry point ----------------------------------------------------------
    def __call__(self, batch: Any) -> pa.Table:
        rows, columns = batch_rows(batch)
        self._hint_unknown_columns(list(columns))
        out: list[dict[str, Any]] = [_empty_row(row) for row in rows]
        with self._lock:
            started = time.time()
            pending = self._validate(rows, out)
            encodes0, hits0 = self.cache.stats.encodes, self.cache.stats.hits
            for group in self._groups(pending):
                self._render_group(group, out, started)
            self._batches += 1
            stats = self.cache.stats
            for row in out:
                row["actor_encodes"], row["actor_cache_hits"] = stats.encodes, stats.hits
        log.info(
            "%s: batch %d, %d rows (%d failed): %d reference encodes, %d cache hits; actor totals %d encodes, "
            "%d hits, %.0f MB cached",
            self.worker_id,
            self._batches,
            len(rows),
            sum(r["error"] is not None for r in out),
            stats.encodes - encodes0,
            stats.hits - hits0,
            stats.encodes,
            stats.hits,
            self.cache.nbytes / 1e6,
        )
        return _output_table(columns, out)

    # -- steps ----------------------------------------------------------------------------------
    def _validate(self, rows: list[dict], out: list[dict]) -> list[_Pending]:
        """Parse every row and read its reference files (each path/URI once per batch)."""
        files: dict[str, bytes | Exception] = {}
        pending = []
        for index, row in enumerate(rows):
            try:
                request = parse_row(
                    row, self.defaults, references_base=self.references_base, allow_empty_prompt=self.allow_empty_prompt
                )
                images = []
                for member, column in zip(request.reference.members, request.reference.columns):
                    if isinstance(member, bytes):
                        images.append(member)
                        continue
                    if member not in files:
                        try:
                            files[member] = read_uri(member, self.s3)
                        except Exception as e:
                            files[member] = e
                    data = files[member]
                    if isinstance(data, Exception):
                        raise RowInputError(column, f"cannot read reference {member}: {data}")
                    images.append(data)
            except RowInputError as e:
                _fail(out[index], str(e), "validate")
                continue
            hashes = [content_hash(data) for data in images]
            layout = request.reference.layout
            reference_hash = hashes[0] if layout == "single" else combined_reference_hash(layout, hashes)
            pending.append(_Pending(index, request, images, reference_hash))
        return pending

    def _groups(self, pending: list[_Pending]) -> list[list[_Pending]]:
        """Rows of one reference and one batch key, in order of first appearance, cut into max_batch forwards."""
        by_key: dict[tuple, list[_Pending]] = {}
        for p in pending:
            by_key.setdefault((self._refkv_key(p), p.request.settings.batch_key()), []).append(p)
        return [
            group[i : i + self.max_batch] for group in by_key.values() for i in range(0, len(group), self.max_batch)
        ]

    @staticmethod
    def _refkv_key(p: _Pending) -> tuple:
        # What a RefKV is valid for, as the job workers key it (cluster/tasks.py ReferenceTask.key).
        s = p.request.settings
        return (p.reference_hash, s.ref_caption, s.ref_megapixels, s.width // 16, s.height // 16)

    def _render_group(self, group: list[_Pending], out: list[dict], started: float) -> None:
        first = group[0]
        s = first.request.settings
        layout = first.request.reference.layout
        sources = first.request.reference.sources()
        requests = [
            RenderRequest(prompt=p.request.prompt, seed=p.request.seed, settings=p.request.settings) for p in group
        ]
        kv, hit = None, False
        try:
            if not s.recompute_reference_every_step:  # that baseline needs the images at every step, not a RefKV
                kv, hit = self.cache.get_or_create(
                    self._refkv_key(first),
                    lambda: self.renderer.encode_reference(
                        first.images,
                        layout=layout,
                        ref_caption=s.ref_caption,
                        ref_megapixels=s.ref_megapixels,
                        width=s.width,
                        height=s.height,
                        sources=sources,
                    ),
                )
        except Exception as e:
            for p in group:
                _fail(out[p.index], _describe(e), "encode")
            return
        try:
            if kv is not None:
                results = self.renderer.render(requests, refkv=kv)
            else:
                results = self.renderer.render(requests, references=first.images, layout=layout)
        except Exception as e:
            for p in group:
                _fail(out[p.index], _describe(e), "sample")
            return
        batch_id = f"{self.worker_id}-{uuid.uuid4().hex[:8]}"
        encode_s = float(getattr(kv, "encode_seconds", 0.0) or results[0].timings.get("encode_s", 0.0))
        for position, (p, result) in enumerate(zip(group, results)):
            row = out[p.index]
            try:
                self._fill(row, p, result, encode_s, started)
            except Exception as e:
                _fail(row, _describe(e), "write")
                continue
            row.update(refkv_cache_hit=hit, batch_id=batch_id, batch_index=position, batch_size=len(group))

    def _fill(self, row: dict, p: _Pending, result, encode_s: float, started: float) -> None:
        request, s = p.request, p.request.settings
        item_id = item_id_for(request.explicit_id, 0, p.reference_hash, request.prompt, request.seed, s)
        settings = s.model_dump()
        row["image"] = encode_rendered_image(
            result.image,
            prompt=request.prompt,
            seed=request.seed,
            settings=settings,
            model=self.model_id,
            adapter=self.adapter_id,
            reference_hash=p.reference_hash,
            item_id=item_id,
        )
        t = result.timings
        row.update({name: settings[name] for name in _METADATA_COLUMNS if name in settings})
        row.update(
            item_id=item_id,
            reference_uris=request.reference.sources(),
            reference_hash=p.reference_hash,
            prompt=request.prompt,
            seed=request.seed,
            settings_json=s.model_dump_json(),
            image_format="png",
            adapter=self.adapter_id,
            model=self.model_id,
            worker_id=self.worker_id,
            node_id=self.node_id,
            encode_s=encode_s,
            sample_s=t.get("sample_s", 0.0),
            decode_s=t.get("decode_s", 0.0),
            started_at=started,
            finished_at=time.time(),
        )

    def _hint_unknown_columns(self, names: list[str]) -> None:
        for hint in unknown_column_hints([n for n in names if n not in self._hinted]):
            log.warning("%s: %s", self.worker_id, hint)
        self._hinted.update(names)


# ---------------------------------------------------------------------------------------------


def _identity() -> tuple[str, str]:
    """(node id, worker id) as job workers name themselves; outside Ray, the host name."""
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
            return node, f"{node[:8]}-{os.getpid()}"
    except ImportError:
        pass
    host = os.uname().nodename
    return host, f"{host}-{os.getpid()}"


def _empty_row(row: dict) -> dict[str, Any]:
    """An output row holding the input's own values of output columns (prompt, seed, settings) where they fit
    the column's type, so that an error row still shows what was asked; a rendered row overwrites them."""
    out: dict[str, Any] = dict.fromkeys(OUTPUT_SCHEMA.names)
    for field in OUTPUT_SCHEMA:
        value = row.get(field.name)
        if value is not None and _fits(value, field.type):
            out[field.name] = value
    return out


def _fits(value: Any, kind: pa.DataType) -> bool:
    if pa.types.is_string(kind):
        return isinstance(value, str)
    if pa.types.is_boolean(kind):
        return isinstance(value, bool)
    if pa.types.is_integer(kind):
        return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63
    if pa.types.is_floating(kind):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return False  # lists, binary: only ever ours


def _fail(row: dict, message: str, stage: str) -> None:
    row.update(error=message, error_stage=stage, image=None)


def _describe(error: BaseException) -> str:
    last = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    where = f" (at {last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last else ""
    return f"{type(error).__name__}: {error}{where}"


def _output_table(columns: dict[str, pa.Array | pa.ChunkedArray], out: list[dict]) -> pa.Table:
    """The input's own columns (those not named like an output column), then OUTPUT_SCHEMA's."""
    ours = pa.Table.from_pylist(out, schema=OUTPUT_SCHEMA)
    passed = {name: col for name, col in columns.items() if name not in OUTPUT_SCHEMA.names}
    if not passed:
        return ours
    table = pa.table(passed)
    for field, column in zip(ours.schema, ours.columns):
        table = table.append_column(field, column)
    return table
