"""A job's manifest rows -> validated work items with stable ids, and row errors.

Everything is checked here, before any GPU work: each row's columns (`service/rows.py`, the one row
parser), its settings (through the request model, resolved for the job's adapter kind: the item id
and every output record hold the settings as rendered), its seeds, its reference files (each unique
URI read once, decoded and hashed) and its layout against what the adapter kind reads. A bad row
becomes one `RowError` per problem, naming the manifest row and the field; the rest of the job carries
on (or, with `strict`, the job refuses to start). Relative reference paths resolve against the
manifest's folder (or s3:// prefix).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from snapref_ray.adapter.controls import SettingsError, resolve_settings
from snapref_ray.adapter.images import ReferenceImageError, content_hash, open_reference
from snapref_ray.requests import RenderRequest, RenderSettings
from snapref_ray.service.references import ReferenceInput, layout_refusal, reference_hash
from snapref_ray.service.rows import RowInputError, RowRules, parse_row
from snapref_ray.storage.backends import S3Options, read_uri
from snapref_ray.storage.jobspec import JobSpec
from snapref_ray.storage.manifest import ROW_KEY, read_manifest
from snapref_ray.uris import base_of

_READ_THREADS = 16  # reference reads are I/O (S3) and hashing/decoding that releases the GIL


@dataclass(frozen=True)
class WorkItem:
    """One image to render: reference + scene prompt + seed + settings (as rendered), with a stable id."""

    item_id: str
    manifest_row: int
    reference: ReferenceInput  # paths / URIs (a job's references are files)
    reference_hash: str  # service/references.py: the content hash, or the pair's / several images' hash
    prompt: str
    seed: int
    settings: RenderSettings  # resolved for the job's adapter kind
    image_index: int  # k-th image of its row

    def request(self) -> RenderRequest:
        """The item as the one request model (prompt, seed, settings)."""
        return RenderRequest(prompt=self.prompt, seed=self.seed, settings=self.settings)


@dataclass
class RowError:
    """A manifest row (or one item of it) that will not be rendered, and why.

    `item_id` is set where the error concerns one item (a duplicate); row-level errors are
    identified by `manifest_row`. `field` is the column at fault, None when no one column is.
    """

    manifest_row: int
    item_id: str | None
    field: str | None
    error: str

    def __str__(self) -> str:
        where = f"row {self.manifest_row}" + (f", field {self.field!r}" if self.field else "")
        return f"{where}: {self.error}"


@dataclass
class ValidatedJob:
    """The outcome of validation: items to render (grouped by reference) and rows that failed."""

    items: list[WorkItem]
    errors: list[RowError]
    rows: int  # manifest rows seen
    reference_hashes: dict[str, str] = field(default_factory=dict)  # uri -> content hash
    reference_sizes: dict[str, int] = field(default_factory=dict)  # uri -> file bytes
    reference_dims: dict[str, tuple[int, int]] = field(default_factory=dict)  # uri -> (width, height)

    def references(self) -> dict[str, ReferenceInput]:
        """References by reference hash, in the order the items use them."""
        return {item.reference_hash: item.reference for item in self.items}


class JobValidationError(ValueError):
    """Strict mode: the manifest has invalid rows, so the job refuses to start."""

    def __init__(self, manifest: str, errors: list[RowError]):
        self.errors = errors
        shown = "\n  ".join(str(error) for error in errors[:50])
        more = f"\n  ... and {len(errors) - 50} more" if len(errors) > 50 else ""
        super().__init__(
            f"manifest {manifest}: {len(errors)} invalid row(s) and the job is strict; "
            f"nothing was rendered:\n  {shown}{more}"
        )


def item_id_for(
    explicit_id: str | None, image_index: int, reference_hash: str, prompt: str, seed: int, settings: RenderSettings
) -> str:
    """Stable item id: "<id>-<image index>" for rows with an id, else a hash of what makes the image.

    `settings` are the resolved ones (as rendered), so the id is the image's and not the wording of
    the request: a row that spells out an adapter kind's default gets the id of one that leaves it unset.
    """
    if explicit_id is not None:
        return f"{explicit_id}-{image_index}"
    chosen = {k: v for k, v in settings.model_dump(mode="json").items() if v is not None}
    canonical = json.dumps(
        {"reference": reference_hash, "prompt": prompt, "seed": seed, "settings": chosen},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def load_work_items(spec: JobSpec, s3: S3Options | None = None, *, adapter_kind: str | None = None) -> ValidatedJob:
    """Read the spec's manifest and validate it: `build_work_items(spec, read_manifest(...))`."""
    s3 = s3 if s3 is not None else spec.s3_options()
    return build_work_items(spec, read_manifest(spec.manifest, s3), s3=s3, adapter_kind=adapter_kind)


def build_work_items(
    spec: JobSpec,
    rows: Iterable[dict[str, Any]],
    *,
    s3: S3Options | None = None,
    read_reference: Callable[[str], bytes] | None = None,
    adapter_kind: str | None = None,
) -> ValidatedJob:
    """Validate manifest rows and expand them into work items.

    `rows` as `read_manifest` gives them (row number under `ROW_KEY`; without it the position
    counts from 1). `read_reference(uri) -> bytes` defaults to reading local or s3:// files with
    `s3` (default: the spec's S3 settings). Each unique reference URI is read once. Settings are
    resolved for `adapter_kind` (the job's adapter file's kind; a setting that does not fit it is
    the row's error). Items come back grouped by reference (in order of first use), in manifest order
    within a group. With `spec.strict`, any error raises `JobValidationError` listing them all.
    """
    if read_reference is None:
        options = s3 if s3 is not None else spec.s3_options()
        read_reference = lambda uri: read_uri(uri, options)  # noqa: E731
    rules = RowRules(base=base_of(spec.manifest), allow_empty_prompt=spec.allow_empty_prompt)
    errors: list[RowError] = []
    parsed: list[tuple[int, Any]] = []
    count = 0
    for position, row in enumerate(rows, start=1):
        count += 1
        number = row.get(ROW_KEY, position)
        try:
            parsed_row = parse_row({k: v for k, v in row.items() if k != ROW_KEY}, spec.defaults, rules)
            settings = resolve_settings(parsed_row.settings, adapter_kind)
        except RowInputError as exc:
            errors.extend(RowError(number, None, p.field, p.message) for p in exc.problems)
            continue
        except SettingsError as exc:
            errors.append(RowError(number, None, exc.field, str(exc).removeprefix(f"{exc.field}: ")))
            continue
        refused = layout_refusal(parsed_row.reference.layout, adapter_kind)
        if refused:  # the check every front door runs (service/references.py `check_reference`)
            errors.append(RowError(number, None, parsed_row.reference.columns[0], refused))
            continue
        parsed.append((number, parsed_row, settings))

    uris = list(dict.fromkeys(uri for _, row, _ in parsed for uri in row.reference.uris))
    checked = _check_references(uris, read_reference)
    job = ValidatedJob(items=[], errors=errors, rows=count)
    for uri, outcome in checked.items():
        if isinstance(outcome, _Image):
            job.reference_hashes[uri] = outcome.hash
            job.reference_sizes[uri] = outcome.size
            job.reference_dims[uri] = outcome.dims

    owner: dict[str, int] = {}  # item id -> manifest row that claimed it first
    for number, row, settings in parsed:
        reference = row.reference
        failures = [
            (column, checked[uri])
            for column, uri in zip(reference.columns, reference.uris)
            if isinstance(checked[uri], str)
        ]
        if failures:
            errors.extend(RowError(number, None, column, message) for column, message in failures)
            continue
        ref_hash = reference_hash(reference.layout, [job.reference_hashes[uri] for uri in reference.uris])
        for image_index, seed in enumerate(row.seeds):
            item_id = item_id_for(row.explicit_id, image_index, ref_hash, row.prompt, seed, settings)
            if item_id in owner:
                errors.append(
                    RowError(number, item_id, "id" if row.explicit_id else None, f"duplicate of row {owner[item_id]}")
                )
                continue
            owner[item_id] = number
            job.items.append(WorkItem(item_id, number, reference, ref_hash, row.prompt, seed, settings, image_index))

    first_use: dict[str, int] = {}
    for item in job.items:
        first_use.setdefault(item.reference_hash, len(first_use))
    job.items.sort(key=lambda item: first_use[item.reference_hash])  # stable: manifest order inside a group
    errors.sort(key=lambda error: error.manifest_row)
    if spec.strict and errors:
        raise JobValidationError(spec.manifest, errors)
    return job


# ---------------------------------------------------------------------------------------------
# Reference files


@dataclass(frozen=True)
class _Image:
    hash: str
    size: int
    dims: tuple[int, int]


def _check_references(uris: list[str], read_reference: Callable[[str], bytes]) -> dict[str, _Image | str]:
    """Read, decode and hash each URI once; an error message (str) in place of a failed one."""
    if not uris:
        return {}
    with ThreadPoolExecutor(max_workers=min(_READ_THREADS, len(uris))) as pool:
        return dict(zip(uris, pool.map(lambda uri: _check_reference(uri, read_reference), uris)))


def _check_reference(uri: str, read_reference: Callable[[str], bytes]) -> _Image | str:
    try:
        data = read_reference(uri)
    except Exception as exc:
        if isinstance(exc, FileNotFoundError) or ("://" not in uri and not os.path.exists(uri)):
            return f"reference file not found: {uri}"
        return f"cannot read reference {uri}: {exc}"
    try:
        image = open_reference(data, uri)
    except ReferenceImageError as exc:
        return str(exc) if uri in str(exc) else f"reference {uri}: {exc}"
    dims = image.size
    image.close()
    return _Image(content_hash(data), len(data), dims)
