"""One output record: what every image the project writes says about how it was made.

A job's metadata row, a Ray Data output row, an image's PNG chunks (`parameters` and `snapref`) and the
endpoint's JSON answer all come from a `RenderedImage` (service.py), whose request holds the settings as
rendered — the adapter kind's defaults filled in — so the same render records the same facts through
every front door. The job and Ray Data share one row builder and one schema (`METADATA_SCHEMA`); the
columns only a job has (where it stored the image, the manifest row, the attempt) are null in Ray Data.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

from snapref_ray.render_service.judges.scores import judgement_columns
from snapref_ray.render_service.work_items import content_id_for
from snapref_ray.storage.image_files import EXTENSIONS, ImageFormat, encode_rendered_image
from snapref_ray.storage.metadata import METADATA_SCHEMA, SETTINGS_IN_METADATA

# Columns only a batch job fills (where its files went, its manifest row, the attempt that made them, the job).
JOB_COLUMNS = (
    "manifest_row",
    "reference_image_key",
    "image_key",
    "image_uri",
    "thumb_key",
    "upload_s",
    "attempt",
    "job",
    "render_of",  # a judged job's: the item this render is of, and which of its renders (0: the first)
    "render_index",
)


def image_extension(fmt: ImageFormat) -> str:
    return EXTENSIONS[fmt]


def encode_output(
    rendered,
    *,
    model: str,
    adapter: str | None,
    item_id: str | None = None,
    fmt: ImageFormat = "png",
    extra_info: dict | None = None,
) -> bytes:
    """The image file of `rendered` (PNG, WebP or JPEG) with its `parameters` and `snapref` records."""
    request = rendered.request
    info = {"forward_batch": rendered.forward_batch, **(extra_info or {})}
    if rendered.skipped_forwards is not None:
        info["skipped_forwards"] = rendered.skipped_forwards
    judgement = getattr(rendered, "judgement", None)
    if judgement is not None:  # the judges' scores and verdicts travel with the image (render_service/judges/)
        info["judgement"] = judgement.model_dump(mode="json")
    return encode_rendered_image(
        rendered.image,
        prompt=request.prompt,
        seed=request.seed,
        settings=request.settings.model_dump(),
        model=model,
        adapter=adapter,
        reference_hash=rendered.reference_hash,
        item_id=item_id,
        fmt=fmt,
        extra_info=info,
    )


def metadata_row(
    rendered,
    *,
    item_id: str,
    reference_uris: list[str],
    model: str,
    adapter: str | None,
    worker_id: str,
    node_id: str,
    image_format: ImageFormat,
    started_at: float,
    **job_columns: Any,
) -> dict[str, Any]:
    """One row of `METADATA_SCHEMA` for `rendered`; `job_columns` are the `JOB_COLUMNS` a job knows."""
    unknown = set(job_columns) - set(JOB_COLUMNS)
    if unknown:
        raise ValueError(f"not job columns: {sorted(unknown)}")
    request = rendered.request
    settings = request.settings
    timings = rendered.timings
    row: dict[str, Any] = dict.fromkeys(METADATA_SCHEMA.names)
    row.update({name: getattr(settings, name) for name in SETTINGS_IN_METADATA})
    row.update(
        item_id=item_id,
        # What the image is made of, beside its id (equal to it unless the manifest row gave an explicit id).
        content_id=content_id_for(rendered.reference_hash, request.prompt, request.seed, settings)
        if rendered.reference_hash is not None
        else None,
        reference_uris=list(reference_uris),
        reference_hash=rendered.reference_hash,
        prompt=request.prompt,
        seed=request.seed,
        settings_json=settings.model_dump_json(),
        image_format=image_format,
        adapter=adapter,
        model=model,
        worker_id=worker_id,
        node_id=node_id,
        encode_s=timings.get("encode_s", 0.0),
        sample_s=timings.get("sample_s", 0.0),
        decode_s=timings.get("decode_s", 0.0),
        forward_batch=rendered.forward_batch,
        skipped_forwards=rendered.skipped_forwards,
        started_at=started_at,
        finished_at=time.time(),
        **job_columns,
    )
    judgement = getattr(rendered, "judgement", None)
    if judgement is not None:  # the worker's scores and verdict (a job's driver re-decides near_duplicate)
        row.update(judgement_columns(judgement), rejected_by=",".join(judgement.rejected_by) or None)
    return {name: row[name] for name in METADATA_SCHEMA.names}


def describe_error(error: BaseException) -> str:
    """`TypeName: message (at file.py:line)`: how a failed item's error is recorded (errors table, error column)."""
    last = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    where = f" (at {last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last else ""
    return f"{type(error).__name__}: {error}{where}"
