"""The report at scale: seconds and peak RSS of `write_report` (plots + gallery pages) as a job's output grows.

    python benchmarks/report_scale.py --items 100000 1000000                       # files, as the job leaves it
    python benchmarks/report_scale.py --items 100000 1000000 --format webdataset --compact
    python benchmarks/report_scale.py --items 100000 --baseline /work/main          # the same run of other code

For each item count (and output format) it writes a committed job output of that many items to a local
folder, as a finished job leaves it: 4 workers, 25 prompts per reference, references handed out in manifest
order, each worker committing a metadata part every 256 rows (the parts of the 4 workers interleaved in commit
order), every METADATA_SCHEMA column filled with values of realistic size (prompts of ~100 characters, the
settings JSON, S3 URIs), a failed item per 1,000, and summary.json. No image is written: the report never
reads one, except that a `webdataset` output gets the thumbnails of its sample (storage/shards.py
`wants_thumbnail`, one in 1,000), which the gallery draws, and its rows name shards instead of files.
With --compact, the parts are then compacted as the driver does when a job resumes (`metadata.compact_parts`).

Then `write_report` runs in a fresh Python process (its own peak RSS, VmHWM, and its CPU seconds, which
a machine shared with other work disturbs less than wall seconds), once per item count,
with this checkout's code, and with --baseline, with the code of another checkout (its PYTHONPATH) on the same
output. Prints one JSON object with a row per (items, format, code) and writes it to --out.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPTS_PER_REFERENCE = 25
WORKERS = 4
PART_ROWS = 256
T0 = 1_760_000_000.0
_WORDS = "a knight in silver armour walks through a rainy neon city at night cinematic light detailed".split()


def _prompt(i: int) -> str:
    words = [_WORDS[(i * 7 + k * 3) % len(_WORDS)] for k in range(16)]
    return f"scene {i}: " + " ".join(words)


def _part(rows: list[int], worker: int, fmt: str, thumb_every: int):
    """One metadata part of the rows numbered `rows` (manifest rows), committed by `worker`."""
    import pyarrow as pa

    from snapref_ray.storage.metadata import METADATA_SCHEMA, image_key, reference_image_key, thumb_key
    from snapref_ray.storage.shards import SHARD_METADATA_SCHEMA, wants_thumbnail

    ids = [f"item-{i:08d}" for i in rows]
    refs = [f"{i // PROMPTS_PER_REFERENCE:064x}" for i in rows]
    started = [T0 + 0.4 * i / WORKERS for i in rows]
    settings = json.dumps({"steps": 30, "cfg": 4.5, "sampler": "er_sde", "scheduler": "simple", "width": 1024})
    columns = {
        "item_id": ids,
        "content_id": [f"{i * 2654435761 % 16**20:020x}" for i in rows],  # the ids are explicit ones: 20 hex digits
        "manifest_row": rows,
        "reference_uris": [[f"s3://bucket/references/character_{i // PROMPTS_PER_REFERENCE}.png"] for i in rows],
        "reference_hash": refs,
        "reference_image_key": [reference_image_key(h) for h in refs],
        "prompt": [_prompt(i) for i in rows],
        "negative_prompt": ["blurry, low quality"] * len(rows),
        "seed": [1000 + i for i in rows],
        "width": [1024] * len(rows),
        "height": [1024] * len(rows),
        "steps": [30] * len(rows),
        "cfg": [4.5] * len(rows),
        "sampler": ["er_sde"] * len(rows),
        "scheduler": ["simple"] * len(rows),
        "mode": ["snapref"] * len(rows),
        "ref_weight": [1.0] * len(rows),
        "ref_guidance": [0.0] * len(rows),
        "ref_in_uncond": [False] * len(rows),
        "correction": ["none"] * len(rows),
        "ref_start": [0.0] * len(rows),
        "ref_end": [1.0] * len(rows),
        "ref_caption": [""] * len(rows),
        "settings_json": [settings] * len(rows),
        "image_format": ["png"] * len(rows),
        "adapter": ["snapref-v1"] * len(rows),
        "model": ["anima-preview"] * len(rows),
        "worker_id": [f"worker-{worker}"] * len(rows),
        "node_id": [f"node-{worker // 2}"] * len(rows),
        "encode_s": [0.0] * len(rows),
        "sample_s": [1.2 + (i % 7) * 0.01 for i in rows],
        "decode_s": [0.05] * len(rows),
        "upload_s": [0.01] * len(rows),
        "forward_batch": [4] * len(rows),
        "skipped_forwards": [None] * len(rows),
        "attempt": [1] * len(rows),
        "started_at": started,
        "finished_at": [s + 1.6 for s in started],
    }
    if fmt == "files":
        columns["image_key"] = [image_key(i) for i in ids]
        columns["image_uri"] = [f"s3://bucket/run/{image_key(i)}" for i in ids]
        columns["thumb_key"] = [thumb_key(i) for i in ids]
        schema = METADATA_SCHEMA
    else:
        shard = f"shards/worker-{worker}-{rows[0]:08d}.tar"
        columns["image_key"] = [None] * len(rows)
        columns["image_uri"] = [f"s3://bucket/run/{shard}#{i}.png" for i in ids]
        columns["thumb_key"] = [thumb_key(i) if wants_thumbnail(i, thumb_every) else None for i in ids]
        columns["shard_key"] = [shard] * len(rows)
        columns["shard_member"] = [f"{i}.png" for i in ids]
        schema = SHARD_METADATA_SCHEMA
    return pa.table({name: columns[name] for name in schema.names}, schema=schema)


def _rows_of(reference: int) -> range:
    return range(reference * PROMPTS_PER_REFERENCE, (reference + 1) * PROMPTS_PER_REFERENCE)


def write_output(root: Path, items: int, fmt: str, *, thumb_every: int = 1000, compact: bool = False) -> dict:
    """A committed job output of `items` items under `root`; what was written."""
    import pyarrow.parquet as pq

    from snapref_ray.storage.backends import open_storage
    from snapref_ray.storage.metadata import ErrorWriter, compact_parts, part_key, write_summary
    from snapref_ray.storage.shards import wants_thumbnail

    t0 = time.perf_counter()
    storage = open_storage(str(root))
    references = -(-items // PROMPTS_PER_REFERENCE)
    # Each worker renders its references (round robin, in manifest order) item by item; parts of PART_ROWS rows
    # are committed as they fill, the workers' parts interleaved in time.
    queues = [[i for r in range(w, references, WORKERS) for i in _rows_of(r) if i < items] for w in range(WORKERS)]
    parts = 0
    for start in range(0, max(len(q) for q in queues), PART_ROWS):
        for w, queue in enumerate(queues):
            rows = queue[start : start + PART_ROWS]
            if rows:
                buf = io.BytesIO()
                pq.write_table(_part(rows, w, fmt, thumb_every), buf, compression="zstd")
                storage.put_bytes(part_key("metadata"), buf.getvalue())
                parts += 1
    thumbs = 0
    if fmt == "webdataset":
        thumb = _tiny_jpeg()
        for i in range(items):
            if wants_thumbnail(f"item-{i:08d}", thumb_every):
                storage.put_bytes(f"thumbs/item-{i:08d}.jpg", thumb)
                thumbs += 1
    with ErrorWriter(storage, flush_rows=100_000, flush_seconds=0) as errors:
        for i in range(0, items, 1000):
            errors.record("RayActorError: worker died", "sample", item_id=f"failed-{i:08d}", manifest_row=items + i)
    write_summary(storage, {"images_this_run": items, "wall_seconds": 0.4 * items / WORKERS + 60})
    compacted = len(compact_parts(storage)) if compact else 0
    return {
        "metadata_parts": len(storage.list("metadata/")),
        "parts_before_compaction": parts,
        "compacted_parts_written": compacted,
        "thumbnails": thumbs,
        "metadata_mib": round(sum(p.stat().st_size for p in (root / "metadata").iterdir()) / 2**20, 1),
        "generate_s": round(time.perf_counter() - t0, 1),
    }


def _tiny_jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (256, 256), (90, 120, 200)).save(buf, format="JPEG")
    return buf.getvalue()


# Run in a fresh process whose snapref_ray comes from PYTHONPATH (this checkout or --baseline's).
_CHILD = """
import json, resource, sys, time


def peak_rss_mib():
    # VmHWM, this process's own high-water mark: ru_maxrss would report the parent's RSS at the fork when
    # that was larger (Linux keeps it across exec), which the parent that generated the output can be.
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)


t0 = time.perf_counter()
from snapref_ray.report import write_report
imported = time.perf_counter()
result = write_report(sys.argv[1])
done = time.perf_counter()
print(json.dumps({
    "report_s": round(done - imported, 2),
    "import_s": round(imported - t0, 2),
    "cpu_s": round(sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), 2),
    "peak_rss_mib": peak_rss_mib(),
    "pages": result["pages"],
    "images": result["images"],
    "shown": result.get("shown"),
    "failed": result["failed_items"] if "failed_items" in result else result["failed"],  # before the split
    "references": result["references"],
}))
"""


def time_report(output: Path, code: Path) -> dict:
    """`write_report(output)` in a fresh process that imports snapref_ray from `code`."""
    env = dict(os.environ, PYTHONPATH=str(code))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(output)], env=env, capture_output=True, text=True, check=False, cwd=code
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--format", nargs="+", choices=("files", "webdataset"), default=["files"])
    parser.add_argument("--compact", action="store_true", help="compact the metadata parts first (a resumed job)")
    parser.add_argument("--baseline", type=Path, help="also time the report with the code of this checkout")
    parser.add_argument("--workdir", type=Path, help="where the outputs go (default: a temporary folder)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="report-scale-", dir=args.workdir))
    rows = []
    try:
        for fmt in args.format:
            for items in args.items:
                root = work / f"{fmt}-{items}"
                written = write_output(root, items, fmt, compact=args.compact)
                codes = [("this", REPO)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
                for name, code in codes:
                    for key in [k for k in os.listdir(root) if k.endswith(".html") or k == "report"]:
                        path = root / key
                        shutil.rmtree(path) if path.is_dir() else path.unlink()
                    row = {"items": items, "format": fmt, "compacted": args.compact, "code": name, **written}
                    row.update(time_report(root, code))
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                shutil.rmtree(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"machine": f"{os.cpu_count()} cores", "rows": rows}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
