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

import contextlib
import csv
import hashlib
import io
import json
import math
import os
import posixpath
from collections.abc import Iterator
from typing import IO, Any

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
    rows = [_row(record, number, uri) for number, record in enumerate(records, start=1)]
    if not rows:
        raise ManifestError(f"manifest {uri} has no rows")
    return rows


def _row(record: dict[str, Any], number: int, uri: str) -> dict[str, Any]:
    if ROW_KEY in record:
        raise ManifestError(f"manifest {uri}: column name {ROW_KEY!r} is reserved for the row number")
    row = {key: value for key, value in record.items() if not _is_missing(value)}
    row[ROW_KEY] = number
    return row


def iter_manifest_chunks(
    uri: str, s3=None, *, chunk_rows: int = 50_000, digest: hashlib._Hash | None = None
) -> Iterator[list[dict[str, Any]]]:
    """`read_manifest`'s rows, the same dicts and row numbers, `chunk_rows` at a time.

    A local file is streamed (CSV and JSONL line by line, Parquet by record batch), so the rows in memory
    are one chunk's, whatever the manifest's size; an s3:// manifest is fetched whole as bytes (its size,
    not its rows as Python objects) and then parsed the same way. Errors are read_manifest's.

    `digest` (a hashlib object, e.g. sha256) is fed the file's bytes as they are read, so that a run records
    what its manifest held without reading it twice; it is whole once the last chunk is out. A local Parquet
    file is the exception: its reader starts at the footer, so it is hashed in one pass of the open file first.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    fmt = manifest_format(uri)
    with _open_binary(uri, s3, digest, whole=fmt == "parquet") as f:
        records = {"csv": _stream_csv, "jsonl": _stream_jsonl, "parquet": _stream_parquet}[fmt](f, uri, chunk_rows)
        chunk: list[dict[str, Any]] = []
        number = 0
        for number, record in enumerate(records, start=1):
            chunk.append(_row(record, number, uri))
            if len(chunk) >= chunk_rows:
                yield chunk
                chunk = []
        if chunk:
            yield chunk
        if number == 0:
            raise ManifestError(f"manifest {uri} has no rows")


@contextlib.contextmanager
def _open_binary(uri: str, s3, digest: hashlib._Hash | None = None, *, whole: bool = False) -> Iterator[IO[bytes]]:
    """The manifest's bytes as a binary file; `digest` is fed them as they are read (see iter_manifest_chunks)."""
    if is_remote(uri):
        try:
            data = read_uri(uri, s3)
        except Exception as exc:
            raise ManifestError(f"cannot read manifest {uri}: {exc}") from exc
        if digest is not None:
            digest.update(data)  # fetched whole already: its bytes are in memory once
        yield io.BytesIO(data)
        return
    path = uri.removeprefix("file://")
    try:
        f = open(path, "rb")
    except FileNotFoundError as exc:
        raise ManifestError(f"manifest {uri} not found") from exc
    except OSError as exc:
        raise ManifestError(f"cannot read manifest {uri}: {exc}") from exc
    with f:
        if digest is None:
            yield f
        elif whole:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
            f.seek(0)
            yield f
        else:
            yield io.BufferedReader(_Hashing(f, digest), buffer_size=1 << 16)


class _Hashing(io.RawIOBase):
    """A binary file that feeds each byte it reads to `digest`, once and in order (a file read front to back)."""

    def __init__(self, f: IO[bytes], digest: hashlib._Hash) -> None:
        self._f, self._digest = f, digest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._f.readinto(buffer)
        if n:
            self._digest.update(memoryview(buffer)[:n])
        return n


def _stream_csv(f: IO[bytes], uri: str, _chunk_rows: int) -> Iterator[dict[str, Any]]:
    text = io.TextIOWrapper(f, encoding="utf-8-sig", newline="")
    reader = csv.reader(text)
    try:
        header = next(reader, None)
        if header is None:
            return
        names = _check_header(header, uri)
        count = 0
        for cells in reader:
            if not any(cell.strip() for cell in cells):
                continue
            count += 1
            if len(cells) > len(names):
                raise ManifestError(
                    f"manifest {uri}: row {count} (line {reader.line_num}) has {len(cells)} cells, "
                    f"the header has {len(names)} columns"
                )
            yield dict(zip(names, cells))
    except UnicodeDecodeError as exc:
        raise ManifestError(f"manifest {uri}: not UTF-8 text ({exc})") from exc


def _stream_jsonl(f: IO[bytes], uri: str, _chunk_rows: int) -> Iterator[dict[str, Any]]:
    for line_number, raw in enumerate(f, start=1):
        line = raw.decode("utf-8-sig") if line_number == 1 else raw.decode("utf-8")
        if line.strip():
            yield _json_record(line, line_number, uri)


def _stream_parquet(f: IO[bytes], uri: str, chunk_rows: int) -> Iterator[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(f).iter_batches(batch_size=chunk_rows)
        for batch in batches:
            yield from batch.to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise ManifestError(f"manifest {uri}: not a readable Parquet file ({exc})") from exc


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
    names = _check_header(header, uri)
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


def _check_header(header: list[str], uri: str) -> list[str]:
    names = [name.strip() for name in header]
    if "" in names:
        raise ManifestError(f"manifest {uri}: header has an empty column name (column {names.index('') + 1})")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ManifestError(f"manifest {uri}: header repeats column(s) {', '.join(duplicates)}")
    return names


def _json_record(line: str, line_number: int, uri: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"manifest {uri}: line {line_number} is not valid JSON ({exc.msg})") from exc
    if not isinstance(record, dict):
        raise ManifestError(f"manifest {uri}: line {line_number} is a JSON {type(record).__name__}, expected an object")
    return record


def _read_jsonl(data: bytes, uri: str) -> list[dict[str, Any]]:
    records = []
    for line_number, line in enumerate(data.decode("utf-8-sig").splitlines(), start=1):
        if line.strip():
            records.append(_json_record(line, line_number, uri))
    return records


def _read_parquet(data: bytes, uri: str) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as exc:
        raise ManifestError(f"manifest {uri}: not a readable Parquet file ({exc})") from exc
    return table.to_pylist()
