"""Manifests in: CSV, JSONL and Parquet files of (reference, scene prompt, settings) rows.

`read_manifest` only reads; it does not judge the columns (that is `work_items`' job, which
knows the request model). Every row comes back as a plain dict with its 1-based manifest row
number under `ROW_KEY` ("__row__"): the N-th data record of the file, the header not counted and
blank lines skipped, so row numbers mean the same thing in all three formats. An empty cell
(CSV), a null (JSONL, Parquet) or a NaN (Parquet written by pandas) means "not given": the key
is left out and the job spec's default applies.

Relative paths inside a manifest (references) resolve against the manifest's folder, or its
key prefix for s3:// manifests: `snapref_ray.uris.base_of` + `resolve_relative`.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import posixpath
from typing import Any

from snapref_ray.storage.backends import read_uri
from snapref_ray.uris import is_remote

ROW_KEY = "__row__"

_FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}


class ManifestError(ValueError):
    """A manifest that cannot be read at all (as opposed to a bad row, which is a RowError)."""


def read_manifest(uri: str, s3=None) -> list[dict[str, Any]]:
    """Read a CSV (with a header row), JSONL/NDJSON or Parquet manifest, chosen by extension.

    `uri` is a local path or an s3:// URI; `s3` is a `S3Options` for s3:// URIs. Returns one
    dict per data record, each with its 1-based row number under `ROW_KEY`; cells that are empty
    or null are left out. Raises `ManifestError` naming the file (and line or row) when the file
    is missing, unreadable, of an unknown format, or has no rows.
    """
    fmt = manifest_format(uri)
    try:
        data = read_uri(uri, s3)
    except Exception as exc:
        if isinstance(exc, FileNotFoundError) or (not is_remote(uri) and not os.path.exists(uri)):
            raise ManifestError(f"manifest {uri} not found") from exc
        raise ManifestError(f"cannot read manifest {uri}: {exc}") from exc
    records = {"csv": _read_csv, "jsonl": _read_jsonl, "parquet": _read_parquet}[fmt](data, uri)
    rows = []
    for number, record in enumerate(records, start=1):
        if ROW_KEY in record:
            raise ManifestError(f"manifest {uri}: column name {ROW_KEY!r} is reserved for the row number")
        row = {key: value for key, value in record.items() if not _is_missing(value)}
        row[ROW_KEY] = number
        rows.append(row)
    if not rows:
        raise ManifestError(f"manifest {uri} has no rows")
    return rows


def manifest_format(uri: str) -> str:
    """'csv', 'jsonl' or 'parquet', from the file extension (case-insensitive)."""
    ext = posixpath.splitext(uri.split("?", 1)[0])[1].lower()
    if ext not in _FORMATS:
        raise ManifestError(
            f"manifest {uri}: unknown extension {ext or '(none)'!r}; expected one of {', '.join(sorted(_FORMATS))}"
        )
    return _FORMATS[ext]


def _is_missing(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, str):
        return value.strip() == ""
    if isinstance(value, float):
        return math.isnan(value)
    return False


def _read_csv(data: bytes, uri: str) -> list[dict[str, Any]]:
    try:
        text = data.decode("utf-8-sig")  # -sig: spreadsheets often write a byte-order mark
    except UnicodeDecodeError as exc:
        raise ManifestError(f"manifest {uri}: not UTF-8 text ({exc})") from exc
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    if header is None:
        raise ManifestError(f"manifest {uri} has no rows")
    names = [name.strip() for name in header]
    if "" in names:
        raise ManifestError(f"manifest {uri}: header has an empty column name (column {names.index('') + 1})")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ManifestError(f"manifest {uri}: header repeats column(s) {', '.join(duplicates)}")
    records = []
    for cells in reader:
        if not any(cell.strip() for cell in cells):
            continue  # blank line: not a record, not counted
        if len(cells) > len(names):
            raise ManifestError(
                f"manifest {uri}: row {len(records) + 1} (line {reader.line_num}) has {len(cells)} cells, "
                f"the header has {len(names)} columns"
            )
        records.append(dict(zip(names, cells)))
    return records


def _read_jsonl(data: bytes, uri: str) -> list[dict[str, Any]]:
    records = []
    for line_number, line in enumerate(data.decode("utf-8-sig").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"manifest {uri}: line {line_number} is not valid JSON ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise ManifestError(
                f"manifest {uri}: line {line_number} is a JSON {type(record).__name__}, expected an object"
            )
        records.append(record)
    return records


def _read_parquet(data: bytes, uri: str) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as exc:
        raise ManifestError(f"manifest {uri}: not a readable Parquet file ({exc})") from exc
    return table.to_pylist()
