"""Manifest rows -> validated work items with stable ids, and row errors.

Everything is checked here, before any GPU work: each row's columns, its settings (through the
request model, `RenderSettings`), its seeds, and its reference files (each unique URI read once,
decoded and hashed). A bad row becomes one `RowError` per problem, naming the manifest row and
the field; the rest of the job carries on (or, with `strict`, the job refuses to start).

Row columns:
  reference                 one image of one character (path or URI)
  references                several images of ONE character: a list, a JSON list or "a.png|b.png"
  left + right              two characters, stitched side by side
  prompt                    the scene prompt (empty only with `allow_empty_prompt`)
  id                        optional stable id; items are then "<id>-<image index>"
  seed | seeds | images_per_prompt   seeds: a list, a JSON list or "1|2|3"; else seed, seed+1, ...
  any RenderSettings field  (negative_prompt, width, height, steps, cfg, sampler, mode, ...)
Relative reference paths resolve against the manifest's folder (or s3:// prefix).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from snapref_ray.adapter.images import ReferenceImageError, content_hash, open_reference
from snapref_ray.requests import RenderRequest, RenderSettings
from snapref_ray.storage.backends import S3Options, read_uri
from snapref_ray.storage.jobspec import JobSpec, RowDefaults
from snapref_ray.storage.manifest import ROW_KEY, manifest_base, read_manifest, resolve_relative

REFERENCE_COLUMNS = ("reference", "references", "left", "right")
ROW_COLUMNS = ("prompt", "id", "seed", "seeds", "images_per_prompt")
SETTING_COLUMNS = tuple(RenderSettings.model_fields)
ALLOWED_COLUMNS = frozenset(REFERENCE_COLUMNS + ROW_COLUMNS + SETTING_COLUMNS)

MAX_ID_LENGTH = 128  # ids become parts of image keys; S3 keys are limited to 1024 bytes
_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_READ_THREADS = 16  # reference reads are I/O (S3) and hashing/decoding that releases the GIL


@dataclass(frozen=True)
class ReferenceSpec:
    """The reference image(s) of a row: one image, several of one character, or a left/right pair."""

    uris: tuple[str, ...]
    layout: Literal["single", "pair", "multi"]


@dataclass(frozen=True)
class WorkItem:
    """One image to render: reference + scene prompt + seed + settings, with a stable id."""

    item_id: str
    manifest_row: int
    reference: ReferenceSpec
    reference_hash: str  # single: content hash of the file; pair/multi: `combined_reference_hash`
    prompt: str
    seed: int
    settings: RenderSettings
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

    def references(self) -> dict[str, ReferenceSpec]:
        """Reference specs by reference hash, in the order the items use them."""
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


def combined_reference_hash(layout: str, member_hashes: Iterable[str]) -> str:
    """Hash of a pair/multi reference: sha256 over the layout and the member hashes in order."""
    return hashlib.sha256("\n".join([layout, *member_hashes]).encode()).hexdigest()


def item_id_for(
    explicit_id: str | None, image_index: int, reference_hash: str, prompt: str, seed: int, settings: RenderSettings
) -> str:
    """Stable item id: "<id>-<image index>" for rows with an id, else a hash of what makes the image."""
    if explicit_id is not None:
        return f"{explicit_id}-{image_index}"
    # Unset (None) settings are left out, so adding an optional setting keeps existing ids.
    chosen = {k: v for k, v in settings.model_dump(mode="json").items() if v is not None}
    canonical = json.dumps(
        {"reference": reference_hash, "prompt": prompt, "seed": seed, "settings": chosen},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def load_work_items(spec: JobSpec, s3: S3Options | None = None) -> ValidatedJob:
    """Read the spec's manifest and validate it: `build_work_items(spec, read_manifest(...))`."""
    s3 = s3 if s3 is not None else spec.s3_options()
    return build_work_items(spec, read_manifest(spec.manifest, s3), s3=s3)


def build_work_items(
    spec: JobSpec,
    rows: Iterable[dict[str, Any]],
    *,
    s3: S3Options | None = None,
    read_reference: Callable[[str], bytes] | None = None,
) -> ValidatedJob:
    """Validate manifest rows and expand them into work items.

    `rows` as `read_manifest` gives them (row number under `ROW_KEY`; without it the position
    counts from 1). `read_reference(uri) -> bytes` defaults to reading local or s3:// files with
    `s3` (default: the spec's S3 settings). Each unique reference URI is read once. Items come
    back grouped by reference (in order of first use), in manifest order within a group. With
    `spec.strict`, any error raises `JobValidationError` listing them all.
    """
    if read_reference is None:
        options = s3 if s3 is not None else spec.s3_options()
        read_reference = lambda uri: read_uri(uri, options)  # noqa: E731
    base = manifest_base(spec.manifest)
    errors: list[RowError] = []
    parsed: list[_Row] = []
    count = 0
    for position, row in enumerate(rows, start=1):
        count += 1
        row_errors: list[RowError] = []
        parsed_row = _parse_row(row, row.get(ROW_KEY, position), spec, base, row_errors)
        errors.extend(row_errors)
        if parsed_row is not None:
            parsed.append(parsed_row)

    uris = list(dict.fromkeys(uri for row in parsed for uri in row.reference.uris))
    checked = _check_references(uris, read_reference)
    job = ValidatedJob(items=[], errors=errors, rows=count)
    for uri, outcome in checked.items():
        if isinstance(outcome, _Image):
            job.reference_hashes[uri] = outcome.hash
            job.reference_sizes[uri] = outcome.size
            job.reference_dims[uri] = outcome.dims

    owner: dict[str, int] = {}  # item id -> manifest row that claimed it first
    for row in parsed:
        failures = [
            (column, checked[uri])
            for column, uri in zip(row.reference_fields, row.reference.uris)
            if isinstance(checked[uri], str)
        ]
        if failures:
            errors.extend(RowError(row.number, None, column, message) for column, message in failures)
            continue
        member_hashes = [job.reference_hashes[uri] for uri in row.reference.uris]
        reference_hash = (
            member_hashes[0]
            if row.reference.layout == "single"
            else combined_reference_hash(row.reference.layout, member_hashes)
        )
        for image_index, seed in enumerate(row.seeds):
            item_id = item_id_for(row.explicit_id, image_index, reference_hash, row.prompt, seed, row.settings)
            if item_id in owner:
                errors.append(
                    RowError(
                        row.number, item_id, "id" if row.explicit_id else None, f"duplicate of row {owner[item_id]}"
                    )
                )
                continue
            owner[item_id] = row.number
            job.items.append(
                WorkItem(
                    item_id, row.number, row.reference, reference_hash, row.prompt, seed, row.settings, image_index
                )
            )

    first_use: dict[str, int] = {}
    for item in job.items:
        first_use.setdefault(item.reference_hash, len(first_use))
    job.items.sort(key=lambda item: first_use[item.reference_hash])  # stable: manifest order inside a group
    errors.sort(key=lambda error: error.manifest_row)
    if spec.strict and errors:
        raise JobValidationError(spec.manifest, errors)
    return job


# ---------------------------------------------------------------------------------------------
# One row


@dataclass
class _Row:
    number: int
    reference: ReferenceSpec
    reference_fields: tuple[str, ...]  # the column each reference URI came from, for messages
    prompt: str
    explicit_id: str | None
    seeds: list[int]
    settings: RenderSettings


def _parse_row(row: dict[str, Any], number: int, spec: JobSpec, base: str, errors: list[RowError]) -> _Row | None:
    """Check every field of a row, appending one RowError per problem; None when any failed."""

    def fail(column: str | None, message: str) -> None:
        errors.append(RowError(number, None, column, message))

    for column in row:
        if column != ROW_KEY and column not in ALLOWED_COLUMNS:
            close = difflib.get_close_matches(column, sorted(ALLOWED_COLUMNS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            fail(
                column,
                f"unknown column {column!r}{hint}; allowed: reference | references | left + right, prompt, "
                "id, seed | seeds | images_per_prompt, and any RenderSettings field",
            )
    reference, reference_fields = _parse_reference(row, base, fail)
    prompt = _parse_prompt(row, spec.allow_empty_prompt, fail)
    explicit_id = _parse_id(row, fail)
    settings, seeds = _parse_settings_and_seeds(row, spec.defaults, fail)
    if errors:
        return None
    return _Row(number, reference, reference_fields, prompt, explicit_id, seeds, settings)


def _parse_reference(row, base, fail) -> tuple[ReferenceSpec | None, tuple[str, ...]]:
    forms = [name for name in ("reference", "references") if name in row]
    if "left" in row or "right" in row:
        forms.append("left + right")
    if not forms:
        fail("reference", "no reference: give a `reference`, `references` or `left` and `right` column")
        return None, ()
    if len(forms) > 1:
        fail(forms[1].split()[0], f"give only one of reference, references or left + right; found {', '.join(forms)}")
        return None, ()
    if forms[0] == "reference":
        paths, columns, layout = [row["reference"]], ("reference",), "single"
    elif forms[0] == "references":
        paths = _split_list(row["references"])
        if paths is None or not paths:
            fail(
                "references",
                f"expected a list of reference paths (a list, a JSON list or 'a.png|b.png'), "
                f"got {_short(row['references'])}",
            )
            return None, ()
        columns, layout = ("references",) * len(paths), ("single" if len(paths) == 1 else "multi")
    else:
        missing = [side for side in ("left", "right") if side not in row]
        if missing:
            fail(missing[0], f"a pair needs both `left` and `right`; {missing[0]!r} is missing")
            return None, ()
        paths, columns, layout = [row["left"], row["right"]], ("left", "right"), "pair"
    uris = []
    for column, path in zip(columns, paths):
        if not isinstance(path, str) or not path.strip():
            fail(column, f"expected a reference path or URI, got {_short(path)}")
            return None, ()
        try:
            uris.append(resolve_relative(path.strip(), base))
        except ValueError as exc:
            fail(column, str(exc))
            return None, ()
    return ReferenceSpec(tuple(uris), layout), columns


def _parse_prompt(row, allow_empty: bool, fail) -> str:
    prompt = row.get("prompt", "")
    if not isinstance(prompt, str):
        fail("prompt", f"expected text, got {_short(prompt)}")
        return ""
    if not prompt.strip() and not allow_empty:
        fail("prompt", "empty prompt (set `allow_empty_prompt: true` in the job spec to allow it)")
    return prompt


def _parse_id(row, fail) -> str | None:
    if "id" not in row:
        return None
    raw = row["id"]
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)  # a Parquet id column written by pandas with gaps comes back as floats
    explicit = _ID_UNSAFE.sub("_", str(raw).strip())
    if len(explicit) > MAX_ID_LENGTH:
        fail("id", f"id is {len(explicit)} characters long, at most {MAX_ID_LENGTH} are allowed")
        return None
    return explicit


def _parse_settings_and_seeds(row, defaults: RowDefaults, fail) -> tuple[RenderSettings | None, list[int]]:
    if "seeds" in row and ("seed" in row or "images_per_prompt" in row):
        present = [name for name in ("seed", "images_per_prompt") if name in row]
        fail("seeds", f"give `seeds`, or `seed` / `images_per_prompt`, not both (found seeds and {', '.join(present)})")
        return None, []
    overrides = {name: row[name] for name in (*SETTING_COLUMNS, "seed", "images_per_prompt") if name in row}
    try:
        # The defaults model validates row values too: the request model's rules apply to both.
        merged = RowDefaults.model_validate({**defaults.model_dump(), **overrides})
    except ValidationError as exc:
        for error in exc.errors():
            fail(str(error["loc"][0]) if error["loc"] else None, _pydantic_message(error))
        merged = None
    seeds = _parse_seeds(row["seeds"], fail) if "seeds" in row else None
    if merged is None or ("seeds" in row and seeds is None):
        return None, []
    if seeds is None:
        seeds = [merged.seed + k for k in range(merged.images_per_prompt)]
        if seeds[-1] >= 2**63:
            fail("seed", f"seed {merged.seed} + {merged.images_per_prompt} images passes the largest seed 2**63 - 1")
            return None, []
    return merged.settings(), seeds


def _parse_seeds(value, fail) -> list[int] | None:
    items = _split_list(value)
    seeds = []
    for item in items or []:
        if isinstance(item, str) and item.strip().isdigit():
            item = int(item)
        elif isinstance(item, float) and item.is_integer():
            item = int(item)
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < 2**63:
            seeds = None
            break
        seeds.append(item)
    if not seeds:
        fail(
            "seeds",
            f"expected a non-empty list of seeds in [0, 2**63) (a list, a JSON list or '1|2|3'), got {_short(value)}",
        )
        return None
    return seeds


def _split_list(value) -> list | None:
    """A list cell: a real list (JSONL, Parquet), a JSON list string, or "a|b|c"; None when neither."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    if not isinstance(value, str):
        return None
    text = value.strip()
    if text.startswith("["):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            return None
        return parsed if isinstance(parsed, list) else None
    return [part.strip() for part in text.split("|")]


def _pydantic_message(error: dict) -> str:
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] not in ("value_error", "assertion_error", "missing") and "input" in error:
        message += f" (got {_short(error['input'])})"
    return message


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
