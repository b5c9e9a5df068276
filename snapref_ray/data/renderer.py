"""`SnapRefRenderer`: the render service as a Ray Data callable class (``ds.map_batches(SnapRefRenderer, ...)``).

Each actor of the pool holds one `RenderService` (snapref_ray/render_service/): the model loaded once, a RefKV
LRU bounded in bytes keyed like every other front door's (`RefKVKey`), settings resolved for the loaded
adapter kind, the memory fit. What is Ray Data's own lives here: a batch's rows are parsed by the one row
parser (render_service/rows.py), rows with the same reference and settings become one batched forward (up to
`max_batch` images), and the output is one row per input row, in order. Across batches the LRU is what
saves encodes, and it only hits when rows of one reference reach the same actor close together: sort or
group the dataset by reference upstream. Ray Data routes batches to actors without looking at keys, so
with N actors a reference is encoded up to N times (the job runner, `snapref-ray render`, encodes it once).

Output: the input's own columns pass through, then `OUTPUT_SCHEMA`: the job's metadata columns
(`METADATA_SCHEMA`, built by the same row builder: the item id a job would give the row, the settings as
rendered; the columns only a job has are null), `image` (PNG bytes with the same `parameters` and
`snapref` chunks as job outputs), `error`/`error_stage`, and per-actor cache counters. A bad row never
raises: it comes back with `error` set and no image. With `judge=` (a `JudgeSpec`), `JUDGED_SCHEMA`: the
same and one `score_<name>` column per score, `phash` and `accepted` (render_service/judges/).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from snapref_ray.data.batches import batch_rows
from snapref_ray.job_spec import S3Spec
from snapref_ray.model_spec import ModelSpec
from snapref_ray.render_service.batching import batch_key, group_batches
from snapref_ray.render_service.judges.scores import JUDGEMENT_COLUMNS, judgement_columns
from snapref_ray.render_service.judges.spec import JudgeSpec
from snapref_ray.render_service.records import describe_error, encode_output, metadata_row
from snapref_ray.render_service.references import Reference, check_reference
from snapref_ray.render_service.refkv_cache import DEFAULT_REFKV_CACHE_BYTES
from snapref_ray.render_service.rows import (
    ParsedRow,
    RowInputError,
    RowProblem,
    RowRules,
    parse_row,
    unknown_column_hints,
)
from snapref_ray.render_service.service import RenderService
from snapref_ray.render_service.work_items import item_id_for
from snapref_ray.requests import RenderRequest, RenderSettings, RowDefaults
from snapref_ray.storage.backends import read_uri
from snapref_ray.storage.metadata import JUDGE_METADATA_COLUMNS, METADATA_SCHEMA
from snapref_ray.uris import resolve_relative

log = logging.getLogger(__name__)

OUTPUT_SCHEMA = pa.schema(
    [f for f in METADATA_SCHEMA if f.name not in JUDGE_METADATA_COLUMNS]  # a judged pipeline adds its own (below)
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
# A judged pipeline's rows: the scores (floats; the pHash distance in bits), the hash as 16 hex digits, the verdict.
_JUDGE_TYPES = {"score_near_duplicate": pa.int32(), "phash": pa.string(), "accepted": pa.bool_()}
JUDGED_SCHEMA = pa.schema(
    list(OUTPUT_SCHEMA) + [pa.field(name, _JUDGE_TYPES.get(name, pa.float64())) for name in JUDGEMENT_COLUMNS]
)


@dataclass
class _Row:
    """A valid row waiting for its render: where it goes in the output, and what it renders."""

    index: int
    parsed: ParsedRow
    settings: RenderSettings  # resolved for the loaded adapter kind
    reference: Reference
    item_id: str


class SnapRefRenderer:
    """Render rows of a Ray Dataset; pass the class (not an instance) to `Dataset.map_batches`.

    `model` is a `ModelSpec` (a models folder, local or s3://, or a mapping of its fields: `models_dir`,
    `adapter`, `loras`, `dtype`, `device`, `compile`, `quantize`), as a job spec's `model:`. `defaults`
    are row defaults (any `RowDefaults` field, for columns a row leaves empty); `refkv_cache_bytes` and
    `max_batch` as in a job's `cluster:`; `s3` as `output.s3` (credentials from the AWS environment).
    `references_base` resolves relative reference paths (default: the actor's working directory, which
    on a local Ray is the driver's, on a cluster the runtime_env's `working_dir`).
    `judge` (a `JudgeSpec` or its mapping) scores every image and adds the `JUDGED_SCHEMA` columns; its
    identity gap's `contrast_reference` path resolves as a row's reference does.
    `renderer_factory(ModelSpec)` replaces the real model loader (benchmarks use a simulated GPU).
    """

    def __init__(
        self,
        model: str | dict | ModelSpec,
        *,
        defaults: dict | None = None,
        refkv_cache_bytes: int = DEFAULT_REFKV_CACHE_BYTES,
        max_batch: int = 4,
        references_base: str | None = None,
        s3: dict | None = None,
        model_cache_dir: str | None = None,
        allow_empty_prompt: bool = False,
        memory_budget_bytes: int | None = None,
        renderer_factory: Callable | None = None,
        judge: dict | JudgeSpec | None = None,
    ) -> None:
        from snapref_ray.render_service.judges.call import judge_call
        from snapref_ray.render_service.loading import load_renderer

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        spec = ModelSpec.model_validate(model)
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.s3 = S3Spec.model_validate(s3 or {}).options()
        self.defaults = RowDefaults.model_validate(defaults or {})
        self.rules = RowRules(
            # A relative path reads as in any Ray task: from the working directory (on a local Ray the driver's,
            # on a cluster the runtime_env's working_dir), unless references_base says where; a local base is made
            # absolute, so that the rows' reference_uris say where the files were.
            base=_absolute(references_base if references_base is not None else "."),
            allow_empty_prompt=allow_empty_prompt,
            inline_images=True,
            one_image=True,
            refuse_unknown_columns=False,
            empty_prompt_hint="pass allow_empty_prompt=True to allow it",
        )
        self.max_batch = max_batch
        self.judge = judge_call(
            JudgeSpec.model_validate(judge) if judge is not None else None,
            lambda path: read_uri(resolve_relative(path, self.rules.base), self.s3),
        )
        self.schema = JUDGED_SCHEMA if self.judge is not None else OUTPUT_SCHEMA
        renderer = (
            renderer_factory(spec) if renderer_factory else load_renderer(spec, s3=self.s3, cache_dir=model_cache_dir)
        )
        self.service = RenderService(
            renderer,
            refkv_cache_bytes=refkv_cache_bytes,
            # Unset: the memory= this actor asked Ray for (`map_batches(..., memory=...)`), as a job's worker does.
            memory_budget_bytes=memory_budget_bytes if memory_budget_bytes is not None else _assigned_memory(),
            model_spec=spec,
        )
        self.node_id, self.worker_id = _identity()
        if self.service.adapter_id is None and renderer_factory is None:
            # Every row has a reference: without an adapter each would fail; say so once, at start.
            raise ValueError(
                "no reference adapter loaded: set model.adapter, or put adapter.safetensors in the models folder"
            )
        self._lock = threading.Lock()  # one batch on the device at a time, whatever the pool's concurrency
        self._batches = 0
        self._hinted: set[str] = set()

    @staticmethod
    def memory_request(model: str | dict | ModelSpec, *, width: int, height: int, max_batch: int, gpu: bool) -> int:
        """Bytes of host memory to pass as `map_batches(..., memory=...)`: what a job's worker asks for
        (render_service/memory_estimate.py `memory_request`), for the pipeline's largest image and `max_batch`;
        0 for model files on s3:// (give `memory=` yourself)."""
        from snapref_ray.render_service.memory_estimate import memory_request

        spec = ModelSpec.model_validate(model)
        return memory_request(spec, width=width, height=height, batch=max_batch, on_gpu=gpu)[0]

    # -- the map_batches entry point ----------------------------------------------------------
    def __call__(self, batch: Any) -> pa.Table:
        rows, columns = batch_rows(batch)
        self._hint_unknown_columns(list(columns))
        out: list[dict[str, Any]] = [_empty_row(row, self.schema) for row in rows]
        stats = self.service.cache.stats
        with self._lock:
            started = time.time()
            encodes0, hits0 = stats.encodes, stats.hits
            pending = self._validate(rows, out)
            for group in group_batches(pending, lambda r: batch_key(r.reference.key, r.settings), self.max_batch):
                self._render_group(group, out, started)
            self._batches += 1
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
            self.service.cache.nbytes / 1e6,
        )
        return _output_table(columns, out, self.schema)

    # -- steps ----------------------------------------------------------------------------------
    def _validate(self, rows: list[dict], out: list[dict]) -> list[_Row]:
        """Parse every row, resolve its settings, read its reference files (each path/URI once per batch) and
        check them as every front door does (render_service/references.py `check_reference`): a row whose reference
        cannot be rendered fails here, naming its column, before any device work."""
        files: dict[str, bytes | Exception] = {}
        checked: set[int] = set()  # ids of the file bytes already decoded (each path once per batch)
        pending = []
        for index, row in enumerate(rows):
            try:
                parsed = parse_row(row, self.defaults, self.rules)
                settings = self._resolve(parsed.settings)
                ref = parsed.reference
                images = [self._member_bytes(m, c, files) for m, c in zip(ref.members, ref.columns)]
                self._check(images, ref.layout, ref.sources(), ref.columns, checked)
            except RowInputError as e:
                _fail(out[index], str(e), "validate")
                continue
            reference = Reference.of_images(images, ref.layout, settings, ref.sources())
            item_id = item_id_for(parsed.explicit_id, 0, reference.hash, parsed.prompt, parsed.seeds[0], settings)
            pending.append(_Row(index, parsed, settings, reference, item_id))
        return pending

    def _check(
        self, images: list[bytes], layout: str, sources: list[str], columns: tuple[str, ...], checked: set[int]
    ) -> None:
        from snapref_ray.engine import RenderError
        from snapref_ray.render_service.references import ReferenceImageError

        unchecked = [(data, src) for data, src in zip(images, sources) if id(data) not in checked]
        try:
            check_reference([d for d, _ in unchecked], layout, [src for _, src in unchecked], self.service.adapter_kind)
            checked.update(id(d) for d, _ in unchecked)
        except ReferenceImageError as e:
            column = columns[sources.index(e.source)] if e.source in sources else columns[0]
            raise RowInputError([RowProblem(column, str(e))]) from None
        except RenderError as e:  # a layout the adapter does not read: the reference columns are at fault
            raise RowInputError([RowProblem(columns[0], e.reason)]) from None

    def _resolve(self, settings: RenderSettings) -> RenderSettings:
        from snapref_ray.engine import RenderError

        try:
            return self.service.resolve(settings)
        except RenderError as e:
            raise RowInputError([RowProblem(e.field, e.reason)]) from None

    def _member_bytes(self, member: bytes | str, column: str, files: dict[str, bytes | Exception]) -> bytes:
        if isinstance(member, bytes):
            return member
        if member not in files:
            try:
                files[member] = read_uri(member, self.s3)
            except Exception as e:  # the row's error, not the actor's
                files[member] = e
        data = files[member]
        if isinstance(data, Exception):
            raise RowInputError([RowProblem(column, f"cannot read reference {member}: {data}")])
        return data

    def _render_group(self, group: list[_Row], out: list[dict], started: float) -> None:
        requests = [RenderRequest(prompt=r.parsed.prompt, seed=r.parsed.seeds[0], settings=r.settings) for r in group]
        try:
            read = self.service.read_reference(group[0].reference, group[0].settings)
        except Exception as e:  # checked at validation; what is left (a failed encode) fails its rows, not the actor
            for r in group:
                _fail(out[r.index], describe_error(e), "encode")
            return
        try:
            rendered = self.service.render(requests, reference=read, judge=self.judge)
        except Exception as e:
            for r in group:
                _fail(out[r.index], describe_error(e), "sample")
            return
        batch_id = f"{self.worker_id}-{uuid.uuid4().hex[:8]}"
        service = self.service
        for position, (r, image) in enumerate(zip(group, rendered)):
            row = out[r.index]
            try:
                row.update(
                    metadata_row(
                        image,
                        item_id=r.item_id,
                        reference_uris=r.parsed.reference.sources(),
                        model=service.model_id,
                        adapter=service.adapter_id,
                        worker_id=self.worker_id,
                        node_id=self.node_id,
                        image_format="png",
                        started_at=started,
                    )
                )
                row["image"] = encode_output(
                    image, model=service.model_id, adapter=service.adapter_id, item_id=r.item_id
                )
            except Exception as e:
                _fail(row, describe_error(e), "write")
                continue
            if self.judge is not None:
                row.update(judgement_columns(image.judgement))
            row.update(
                refkv_cache_hit=read.source == "cache", batch_id=batch_id, batch_index=position, batch_size=len(group)
            )

    def _hint_unknown_columns(self, names: list[str]) -> None:
        for hint in unknown_column_hints([n for n in names if n not in self._hinted]):
            log.warning("%s: %s", self.worker_id, hint)
        self._hinted.update(names)


# ---------------------------------------------------------------------------------------------


def _absolute(base: str) -> str:
    return base if "://" in base else os.path.abspath(os.path.expanduser(base))


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


def _assigned_memory() -> int | None:
    """The bytes of memory Ray assigned this actor (its `memory=`); None outside Ray or when it asked for none."""
    try:
        import ray

        if ray.is_initialized():
            return int(ray.get_runtime_context().get_assigned_resources().get("memory", 0)) or None
    except ImportError:
        pass
    return None


def _empty_row(row: dict, schema: pa.Schema) -> dict[str, Any]:
    """An output row holding the input's own values of output columns (prompt, seed, settings) where they fit
    the column's type, so that an error row still shows what was asked; a rendered row overwrites them."""
    out: dict[str, Any] = dict.fromkeys(schema.names)
    for field in schema:
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


def _output_table(columns: dict[str, pa.Array | pa.ChunkedArray], out: list[dict], schema: pa.Schema) -> pa.Table:
    """The input's own columns (those not named like an output column), then `schema`'s (OUTPUT_SCHEMA's)."""
    ours = pa.Table.from_pylist(out, schema=schema)
    passed = {name: col for name, col in columns.items() if name not in schema.names}
    if not passed:
        return ours
    table = pa.table(passed)
    for field, column in zip(ours.schema, ours.columns):
        table = table.append_column(field, column)
    return table
