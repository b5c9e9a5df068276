"""Manifests: CSV / JSONL / Parquet, local and s3://, row numbers, relative paths, clear errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from snapref_ray.storage.manifest import ROW_KEY, ManifestError, manifest_format, read_manifest
from snapref_ray.uris import base_of, resolve_relative

ROWS = [
    {"reference": "refs/a.png", "prompt": "1girl, solo, beach", "seed": 3, "steps": 8},
    {"reference": "refs/b.png", "prompt": "1boy, solo, rain, night", "seed": None, "steps": None},
    {"reference": "refs/a.png", "prompt": "1girl, cafe, smile", "seed": 5, "steps": 12},
]


def write_csv(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_three_formats_give_the_same_rows(tmp_path):
    csv_rows = read_manifest(str(write_csv(tmp_path / "m.csv", ROWS)))
    jsonl_rows = read_manifest(str(write_jsonl(tmp_path / "m.jsonl", ROWS)))
    ndjson_rows = read_manifest(str(write_jsonl(tmp_path / "m.NDJSON", ROWS)))
    parquet_rows = read_manifest(str(write_parquet(tmp_path / "m.parquet", ROWS)))

    # Typed formats keep their types; CSV cells are text (the request model converts them later).
    expected = [
        {"reference": "refs/a.png", "prompt": "1girl, solo, beach", "seed": 3, "steps": 8, ROW_KEY: 1},
        {"reference": "refs/b.png", "prompt": "1boy, solo, rain, night", ROW_KEY: 2},  # nulls / empty cells left out
        {"reference": "refs/a.png", "prompt": "1girl, cafe, smile", "seed": 5, "steps": 12, ROW_KEY: 3},
    ]
    assert jsonl_rows == expected
    assert ndjson_rows == expected
    assert parquet_rows == expected
    assert csv_rows == [
        {k: (str(v) if k not in ("prompt", ROW_KEY) else v) for k, v in row.items()} for row in expected
    ]


def test_csv_row_numbers_count_records_not_lines(tmp_path):
    path = tmp_path / "m.csv"
    path.write_bytes(
        '\ufeffreference , prompt\n\na.png,"1girl, solo"\n  ,  \nb.png,"multi\nline"\nc.png,x\n'.encode("utf-8")
    )
    rows = read_manifest(str(path))
    # BOM and padded header names are tolerated; blank lines are neither records nor counted.
    assert rows == [
        {"reference": "a.png", "prompt": "1girl, solo", ROW_KEY: 1},
        {"reference": "b.png", "prompt": "multi\nline", ROW_KEY: 2},
        {"reference": "c.png", "prompt": "x", ROW_KEY: 3},
    ]


def test_parquet_nan_and_list_cells(tmp_path):
    table = pa.table({"references": [["a.png", "b.png"], None], "prompt": ["p1", "p2"], "cfg": [float("nan"), 5.0]})
    path = tmp_path / "m.parquet"
    pq.write_table(table, path)
    assert read_manifest(str(path)) == [
        {"references": ["a.png", "b.png"], "prompt": "p1", ROW_KEY: 1},
        {"prompt": "p2", "cfg": 5.0, ROW_KEY: 2},
    ]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("m.txt", b"x", "manifest {path}: unknown extension '.txt'; expected one of .csv, .jsonl, .ndjson, .parquet"),
        ("m.csv", b"reference,prompt\n", "manifest {path} has no rows"),
        ("m.csv", b"", "manifest {path} has no rows"),
        ("m.csv", b"reference,prompt,reference\na,b,c\n", "manifest {path}: header repeats column(s) reference"),
        ("m.csv", b"reference,,prompt\na,b,c\n", "manifest {path}: header has an empty column name (column 2)"),
        (
            "m.csv",
            b"reference,prompt\na.png,p\nb.png,p,extra\n",
            "manifest {path}: row 2 (line 3) has 3 cells, the header has 2 columns",
        ),
        ("m.csv", b"reference,__row__\na,1\n", "manifest {path}: column name '__row__' is reserved for the row number"),
        ("m.csv", b"reference\n\xff\xfe\n", "manifest {path}: not UTF-8 text"),
        (
            "m.jsonl",
            b'{"reference": "a"}\n\n{"reference": \n',
            "manifest {path}: line 3 is not valid JSON (Expecting value)",
        ),
        ("m.jsonl", b'["a", "b"]\n', "manifest {path}: line 1 is a JSON list, expected an object"),
        ("m.parquet", b"PAR1 not really", "manifest {path}: not a readable Parquet file"),
    ],
)
def test_unreadable_manifests_name_file_and_place(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ManifestError) as info:
        read_manifest(str(path))
    assert str(info.value).startswith(message.format(path=path))


def test_missing_manifest(tmp_path):
    with pytest.raises(ManifestError, match=r"^manifest .*nope\.csv not found$"):
        read_manifest(str(tmp_path / "nope.csv"))


def test_manifest_format_by_extension():
    assert [manifest_format(u) for u in ("a.CSV", "s3://b/x/m.jsonl", "m.ndjson", "/d/m.parquet")] == [
        "csv",
        "jsonl",
        "jsonl",
        "parquet",
    ]


def test_relative_paths_resolve_against_the_manifest_folder(tmp_path):
    base = base_of(str(tmp_path / "jobs" / "m.csv"))
    assert base == str(tmp_path / "jobs")
    assert resolve_relative("refs/a.png", base) == str(tmp_path / "jobs" / "refs" / "a.png")
    assert resolve_relative("./refs/../b.png", base) == str(tmp_path / "jobs" / "b.png")
    assert resolve_relative("../common/c.png", base) == str(tmp_path / "common" / "c.png")
    assert resolve_relative("/abs/d.png", base) == "/abs/d.png"
    assert resolve_relative("s3://other/e.png", base) == "s3://other/e.png"
    # A manifest given relative to the current directory still resolves to absolute paths.
    assert Path(base_of("m.csv")).is_absolute()


def test_relative_paths_resolve_against_the_s3_prefix():
    base = base_of("s3://bucket/jobs/2024/m.csv")
    assert base == "s3://bucket/jobs/2024/"
    assert resolve_relative("refs/a.png", base) == "s3://bucket/jobs/2024/refs/a.png"
    assert resolve_relative("../refs/a.png", base) == "s3://bucket/jobs/refs/a.png"
    assert resolve_relative("/local/a.png", base) == "/local/a.png"
    assert resolve_relative("a.png", base_of("s3://bucket/m.csv")) == "s3://bucket/a.png"
    with pytest.raises(ValueError, match=r"relative path '../../../a.png' climbs above the bucket root"):
        resolve_relative("../../../a.png", base)


def test_s3_manifest_reads_like_a_local_one(tmp_path, s3_server):
    local = write_csv(tmp_path / "m.csv", ROWS)
    bucket, prefix, client = s3_server.bucket, "test_manifest", s3_server.client()
    client.put_object(Bucket=bucket, Key=f"{prefix}/m.csv", Body=local.read_bytes())
    client.put_object(
        Bucket=bucket, Key=f"{prefix}/m.parquet", Body=write_parquet(tmp_path / "m.parquet", ROWS).read_bytes()
    )
    options = s3_server.s3_options()

    assert read_manifest(f"s3://{bucket}/{prefix}/m.csv", options) == read_manifest(str(local))
    assert read_manifest(f"s3://{bucket}/{prefix}/m.parquet", options) == read_manifest(str(tmp_path / "m.parquet"))
    with pytest.raises(ManifestError) as info:
        read_manifest(f"s3://{bucket}/{prefix}/missing.csv", options)
    assert str(info.value) == (
        f"cannot read manifest s3://{bucket}/{prefix}/missing.csv: no object "
        f"'{prefix}/missing.csv' in storage s3://{bucket} "
        f"(s3://{bucket}/{prefix}/missing.csv does not exist)"
    )


def _random_manifest(rng, n: int) -> list[dict]:
    """Rows with the cells manifests have: paths, prompts with commas, quotes and non-ASCII text, numbers,
    empty cells (left out), an explicit id on some rows."""
    words = ["1girl", "solo", "café", 'say "hi"', "night, rain", "海辺", "smile"]
    rows = []
    for i in range(n):
        row = {
            "reference": f"refs/{rng.randrange(5)}.png",
            "prompt": ", ".join(rng.sample(words, rng.randrange(1, 4))),
            "seed": str(rng.randrange(10**6)) if rng.random() < 0.7 else "",
            "steps": str(rng.randrange(1, 40)) if rng.random() < 0.3 else "",
            "id": f"row{i}" if rng.random() < 0.5 else "",
        }
        rows.append(row)
    return rows


def _write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            for i, row in enumerate(rows):
                writer.writerow(row)
                if i % 7 == 3:
                    f.write("\n")  # a blank line: not a record
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({k: v for k, v in r.items() if v}) + "\n" for r in rows), encoding="utf-8")
    else:
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    return path


@pytest.mark.parametrize("ext", [".csv", ".jsonl", ".parquet"])
def test_a_manifest_read_in_chunks_gives_the_rows_read_whole(tmp_path, ext):
    import random

    from snapref_ray.storage.manifest import iter_manifest_chunks

    rng = random.Random(ext)
    for n in (1, 2, 23, 61):
        path = _write(tmp_path / f"m{n}{ext}", _random_manifest(rng, n))
        whole = read_manifest(str(path))
        assert len(whole) == n
        for chunk_rows in sorted({1, 2, 3, 5, 7, 16, n - 1, n, n + 1, rng.randrange(1, n + 2)} - {0}):
            chunks = list(iter_manifest_chunks(str(path), chunk_rows=chunk_rows))
            assert all(0 < len(c) <= chunk_rows for c in chunks)
            assert all(len(c) == chunk_rows for c in chunks[:-1])
            assert [row for chunk in chunks for row in chunk] == whole, (n, chunk_rows)


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("m.csv", b"reference,prompt\na.png,p\nb.png,p,extra\n"),
        ("m.csv", b"reference,__row__\na,1\n"),
        ("m.csv", b"reference\n\xff\xfe\n"),
        ("m.csv", b"reference,reference\na,b\n"),
        ("m.csv", b""),
        ("m.jsonl", b'{"reference": "a"}\n\n{"reference": \n'),
        ("m.jsonl", b'["a", "b"]\n'),
        ("m.parquet", b"PAR1 not really"),
    ],
)
def test_a_manifest_read_in_chunks_fails_as_read_whole(tmp_path, name, content):
    from snapref_ray.storage.manifest import iter_manifest_chunks

    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ManifestError) as whole:
        read_manifest(str(path))
    with pytest.raises(ManifestError) as chunked:
        for _ in iter_manifest_chunks(str(path), chunk_rows=1):
            pass
    # The same message, up to the parser's own detail in parentheses (it names a buffer rather than the file).
    assert str(chunked.value).split(" (")[0] == str(whole.value).split(" (")[0]
    assert str(chunked.value).startswith(f"manifest {path}")


def test_an_s3_manifest_reads_in_chunks_like_a_local_one(tmp_path, s3_server):
    import random

    from snapref_ray.storage.manifest import iter_manifest_chunks

    path = _write(tmp_path / "m.jsonl", _random_manifest(random.Random(3), 11))
    s3_server.client().put_object(Bucket=s3_server.bucket, Key="chunked/m.jsonl", Body=path.read_bytes())
    uri = f"s3://{s3_server.bucket}/chunked/m.jsonl"
    chunks = list(iter_manifest_chunks(uri, s3_server.s3_options(), chunk_rows=4))
    assert [len(c) for c in chunks] == [4, 4, 3]
    assert [r for c in chunks for r in c] == read_manifest(str(path))


@pytest.mark.parametrize("ext", [".csv", ".jsonl", ".parquet"])
def test_the_digest_is_the_sha256_of_the_manifest_bytes_from_the_one_read(tmp_path, ext, monkeypatch):
    """The run's record of its manifest: sha256 of the file as read, fed while the chunks are read (the file is
    opened once), whatever the chunk size; the rows are the same as without a digest."""
    import hashlib
    import random

    from snapref_ray.storage import manifest as manifest_module
    from snapref_ray.storage.manifest import iter_manifest_chunks

    path = _write(tmp_path / f"m{ext}", _random_manifest(random.Random(ext), 5_000))
    opened: list[str] = []

    def counting_open(file, *args, **kwargs):
        opened.append(str(file))
        return open(file, *args, **kwargs)

    monkeypatch.setattr(manifest_module, "open", counting_open, raising=False)
    plain = [row for chunk in iter_manifest_chunks(str(path), chunk_rows=999) for row in chunk]
    for chunk_rows in (1, 999, 10_000):
        opened.clear()
        digest = hashlib.sha256()
        rows = [row for chunk in iter_manifest_chunks(str(path), chunk_rows=chunk_rows, digest=digest) for row in chunk]
        assert rows == plain and opened == [str(path)]
        assert digest.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest(), chunk_rows


def test_the_digest_of_an_s3_manifest_is_taken_from_its_one_get(tmp_path, s3_server, monkeypatch):
    import hashlib
    import random

    from snapref_ray.storage import manifest as manifest_module
    from snapref_ray.storage.manifest import iter_manifest_chunks

    path = _write(tmp_path / "m.csv", _random_manifest(random.Random(5), 300))
    s3_server.client().put_object(Bucket=s3_server.bucket, Key="digest/m.csv", Body=path.read_bytes())
    reads: list[str] = []
    real_read = manifest_module.read_uri
    monkeypatch.setattr(manifest_module, "read_uri", lambda uri, s3: reads.append(uri) or real_read(uri, s3))
    digest = hashlib.sha256()
    chunks = list(iter_manifest_chunks(f"s3://{s3_server.bucket}/digest/m.csv", s3_server.s3_options(), digest=digest))
    assert sum(len(c) for c in chunks) == 300 and len(reads) == 1
    assert digest.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
