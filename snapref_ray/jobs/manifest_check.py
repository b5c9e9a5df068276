"""A job's manifest rows -> validated work items with stable ids, and row errors.

Everything is checked here, before any GPU work: each row's columns (`render_service/rows.py`, the one row
parser), its settings (through the request model, resolved for the job's adapter kind: the item id
and every output record hold the settings as rendered), its seeds, its reference files (each unique
URI read once, decoded and hashed) and its layout against what the adapter kind reads. A bad row
becomes one `RowError` per problem, naming the manifest row and the field; the rest of the job carries
on (or, with `strict`, the job refuses to start). Relative reference paths resolve against the
manifest's folder (or s3:// prefix).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from snapref_ray.adapter.controls import SettingsError, resolve_settings
from snapref_ray.adapter.images import content_hash, open_reference
from snapref_ray.job_spec import JobSpec
from snapref_ray.render_service.references import ReferenceImageError, ReferenceInput, layout_refusal, reference_hash
from snapref_ray.render_service.rows import RowInputError, RowRules, parse_row
from snapref_ray.render_service.work_items import WorkItem, item_id_for_json, settings_json
from snapref_ray.requests import RenderSettings, RowDefaults
from snapref_ray.storage.backends import S3Options, read_uri
from snapref_ray.storage.id_claims import ClaimedIds
from snapref_ray.storage.manifest import ROW_KEY, read_manifest
from snapref_ray.uris import base_of

_READ_THREADS = 16  # reference reads are I/O (S3) and hashing/decoding that releases the GIL


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

    def __init__(self, manifest: str, errors: list[RowError], count: int | None = None):
        """`errors`: the errors (or the first of them, when `count` says how many there are)."""
        self.errors = errors
        count = len(errors) if count is None else count
        shown = "\n  ".join(str(error) for error in errors[:50])
        more = f"\n  ... and {count - 50} more" if count > 50 else ""
        super().__init__(
            f"manifest {manifest}: {count} invalid row(s) and the job is strict; nothing was rendered:\n  {shown}{more}"
        )


@dataclass(frozen=True)
class ManifestSettings:
    """What validating a job's manifest needs of its spec: the planner's narrow view (jobs/job_settings.py)."""

    manifest: str  # local path or s3:// URI; relative reference paths resolve against its folder
    defaults: RowDefaults  # what a row leaves out
    allow_empty_prompt: bool = False
    strict: bool = False  # any invalid row refuses the whole job (after every row is read, so all are named)
    s3: S3Options | None = None  # for the manifest and the references

    @classmethod
    def of(cls, spec: JobSpec, *, s3: S3Options | None = None) -> ManifestSettings:
        """The spec's manifest settings; `s3`: the spec's S3 settings where the caller has them already."""
        return cls(
            manifest=spec.manifest,
            defaults=spec.defaults,
            allow_empty_prompt=spec.allow_empty_prompt,
            strict=spec.strict,
            s3=s3 if s3 is not None else spec.s3_options(),
        )


def load_work_items(spec: JobSpec, s3: S3Options | None = None, *, adapter_kind: str | None = None) -> ValidatedJob:
    """Read the spec's manifest and validate it: `build_work_items(spec, read_manifest(...))`.

    The whole job in memory: for tests and small jobs. A batch job plans through jobs/spilled_items.py,
    which validates the manifest in chunks with the same `ManifestValidator`."""
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
    settings = ManifestSettings.of(spec, s3=s3)
    validator = ManifestValidator(settings, read_reference=read_reference, adapter_kind=adapter_kind)
    chunk = validator.validate(list(rows))
    job = ValidatedJob(items=chunk.items, errors=chunk.errors, rows=chunk.rows)
    for uri, outcome in validator.checked.items():
        if isinstance(outcome, _Image):
            job.reference_hashes[uri] = outcome.hash
            job.reference_sizes[uri] = outcome.size
            job.reference_dims[uri] = outcome.dims
    # stable: manifest order inside a group
    job.items.sort(key=lambda item: validator.reference_group(item.reference_hash))
    if spec.strict and job.errors:
        raise JobValidationError(spec.manifest, job.errors)
    return job


@dataclass
class ValidatedChunk:
    """One chunk of a manifest, validated: its items (in manifest order), its rows' errors, how many rows."""

    items: list[WorkItem]
    errors: list[RowError]
    rows: int


class ManifestValidator:
    """Validates a manifest's rows a chunk at a time, with what must hold across chunks kept compact.

    Across chunks it remembers: each reference URI's check (a file is read, decoded and hashed once), the item ids
    claimed so far with the row that claimed each (`ClaimedIds`: 16 bytes an id, so a duplicate is found however
    far apart the two rows are), the references in order of first use (`reference_group`) and the distinct
    resolved settings (`settings_index`: rows that ask for the same settings share one object). Row numbers are
    the manifest's (`ROW_KEY`), else positions counted on from the previous chunk's.
    """

    def __init__(
        self,
        settings: ManifestSettings,
        *,
        read_reference: Callable[[str], bytes] | None = None,
        adapter_kind: str | None = None,
    ) -> None:
        if read_reference is None:
            read_reference = lambda uri: read_uri(uri, settings.s3)  # noqa: E731
        self.defaults, self.adapter_kind, self._read = settings.defaults, adapter_kind, read_reference
        self._rules = RowRules(base=base_of(settings.manifest), allow_empty_prompt=settings.allow_empty_prompt)
        self.checked: dict[str, _Image | str] = {}  # uri -> its image's figures, or why it cannot be used
        self.claimed = ClaimedIds()
        self.rows_seen = 0
        self._groups: dict[str, int] = {}  # reference hash -> its index in order of first use
        self.settings: list[RenderSettings] = []  # distinct resolved settings, by index
        self._texts: list[str] = []  # their canonical JSON (what an item id hashes)
        self._settings_json: dict[str, int] = {}  # canonical JSON -> index
        self._settings_of_object: dict[int, int] = {}  # id(one of self.settings) -> index; they live as long
        self._resolved: dict[int, tuple[RenderSettings, int]] = {}  # id(asked settings) -> (them, resolved index)

    def done(self) -> None:
        """The manifest is read: drop what only validation needs (the claimed ids, the reference checks, the
        group index); what reads the items back needs only `settings`."""
        self.claimed = ClaimedIds()
        self.checked.clear()
        self._groups.clear()
        self._resolved.clear()

    def reference_group(self, reference_hash: str) -> int:
        """The reference's place in the order of first use (0, 1, ...)."""
        return self._groups.setdefault(reference_hash, len(self._groups))

    def settings_index(self, settings: RenderSettings) -> int:
        """The index of these resolved settings in `self.settings` (they are one of its objects)."""
        return self._settings_of_object[id(settings)]

    def validate(self, rows: Sequence[dict[str, Any]]) -> ValidatedChunk:
        errors: list[RowError] = []
        parsed: list[tuple[int, Any, RenderSettings, str]] = []
        for row in rows:
            self.rows_seen += 1
            number = row.get(ROW_KEY, self.rows_seen)
            try:
                parsed_row = parse_row(
                    {k: v for k, v in row.items() if k != ROW_KEY}, self.defaults, self._rules, number
                )
                settings, settings_text = self._resolve(parsed_row.settings)
            except RowInputError as exc:
                errors.extend(RowError(exc.index, None, p.field, p.message) for p in exc.problems)
                continue
            except SettingsError as exc:
                errors.append(RowError(number, None, exc.field, exc.reason))
                continue
            refused = layout_refusal(parsed_row.reference.layout, self.adapter_kind)
            if refused:  # the check every front door runs (render_service/references.py `check_reference`)
                errors.append(RowError(number, None, parsed_row.reference.columns[0], refused))
                continue
            parsed.append((number, parsed_row, settings, settings_text))

        uris_of = {id(row): row.reference.uris for _, row, _, _ in parsed}
        new_uris = list(dict.fromkeys(u for uris in uris_of.values() for u in uris if u not in self.checked))
        self.checked.update(_check_references(new_uris, self._read))

        candidates: list[tuple[int, str | None, WorkItem]] = []
        for number, row, settings, settings_text in parsed:
            reference, uris = row.reference, uris_of[id(row)]
            images = [self.checked[uri] for uri in uris]
            if any(isinstance(image, str) for image in images):
                errors.extend(
                    RowError(number, None, column, image)
                    for column, image in zip(reference.columns, images)
                    if isinstance(image, str)
                )
                continue
            ref_hash = reference_hash(reference.layout, [image.hash for image in images])
            self.reference_group(ref_hash)
            for image_index, seed in enumerate(row.seeds):
                content_id = item_id_for_json(None, image_index, ref_hash, row.prompt, seed, settings_text)
                explicit = row.explicit_id is not None
                item_id = (
                    item_id_for_json(row.explicit_id, image_index, ref_hash, row.prompt, seed, settings_text)
                    if explicit
                    else content_id
                )
                item = WorkItem(
                    item_id,
                    number,
                    reference,
                    ref_hash,
                    row.prompt,
                    seed,
                    settings,
                    image_index,
                    content_id if explicit else None,
                )
                candidates.append((number, row.explicit_id, item))

        owners = self.claimed.claim([c[2].item_id for c in candidates], [c[0] for c in candidates])
        items = []
        for (number, explicit_id, item), owner in zip(candidates, owners):
            if owner is None:
                items.append(item)
            else:
                field = "id" if explicit_id else None
                errors.append(RowError(number, item.item_id, field, f"duplicate of row {owner}"))
        errors.sort(key=lambda error: error.manifest_row)  # stable: a row's errors in the order found
        return ValidatedChunk(items, errors, len(rows))

    def _resolve(self, asked: RenderSettings) -> tuple[RenderSettings, str]:
        """The settings as rendered for the adapter kind, interned: (one shared object, its canonical JSON)."""
        known = self._resolved.get(id(asked))
        if known is not None and known[0] is asked:
            index = known[1]
            return self.settings[index], self._texts[index]
        resolved = resolve_settings(asked, self.adapter_kind)
        text = settings_json(resolved)
        index = self._settings_json.get(text)
        if index is None:
            index = self._settings_json[text] = len(self.settings)
            self.settings.append(resolved)
            self._texts.append(text)
            self._settings_of_object[id(resolved)] = index
        if len(self._resolved) > 10_000:  # rows whose settings are never shared (unhashable cells): stay bounded
            self._resolved.clear()
        self._resolved[id(asked)] = (asked, index)
        return self.settings[index], text


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
        return str(exc) if exc.source == uri else f"reference {uri}: {exc}"
    dims = image.size
    image.close()
    return _Image(content_hash(data), len(data), dims)
