"""The explicit-id check at scale: time and peak RSS of what a resume adds to read a committed output's content ids.

    python benchmarks/explicit_ids_scale.py --items 1000000 3000000

For each item count it writes an output whose metadata parts (100,000 rows each) hold only `item_id` (explicit
ids, `row-<n>-0`) and `content_id` (20 hex digits), then, in a fresh Python process each (its own peak RSS,
Linux VmHWM): `ids`, the committed set every resume reads (`ledger.committed_item_ids`), and `contents`, the check
(`item_contents.read_committed_contents`, then `compare_run` over the plan's items in runs of 50,000, one in 1,000
of them edited). Prints one JSON line per measurement: seconds, what is held afterwards, the peak's growth.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

MiB = 2**20
PART_ROWS = 100_000
RUN_ROWS = 50_000


def _ids(rows: np.ndarray) -> pa.Array:
    return pa.array(np.char.mod("row-%d-0", rows).astype(str))


def _contents(rows: np.ndarray) -> np.ndarray:
    return np.char.mod("%020x", (rows * 2654435761) % 16**15).astype(str)


def write_output(folder: Path, items: int) -> None:
    from snapref_ray.storage.backends import open_storage

    storage = open_storage(str(folder))
    for start in range(0, items, PART_ROWS):
        rows = np.arange(start, min(items, start + PART_ROWS))
        table = pa.table({"item_id": _ids(rows), "content_id": pa.array(_contents(rows))})
        buf = io.BytesIO()
        pq.write_table(table, buf)
        storage.put_bytes(f"metadata/part-{start:012d}-bench.parquet", buf.getvalue())


def measure(folder: Path, items: int, what: str) -> dict:
    from snapref_ray.render_service.memory import peak_resident_bytes, reset_peak_resident
    from snapref_ray.storage.backends import open_storage
    from snapref_ray.storage.item_contents import compare_run, read_committed_contents
    from snapref_ray.storage.ledger import committed_item_ids

    storage = open_storage(str(folder))
    reset_peak_resident()
    base, t0 = peak_resident_bytes(), time.time()
    figures: dict = {}
    if what == "ids":
        held = committed_item_ids(storage).nbytes
    else:
        contents = read_committed_contents(storage, "this-job")
        held = contents.explicit.nbytes + contents.contents.nbytes
        changed = 0
        for start in range(0, items, RUN_ROWS):
            rows = np.arange(start, min(items, start + RUN_ROWS))
            now = _contents(rows)
            now[::1000] = "f" * 20  # an edited row in every 1,000
            changed += int(compare_run(contents, _ids(rows), pa.array(now))[0].sum())
        figures["changed"] = changed
    return {
        "items": items,
        "what": what,
        "seconds": round(time.time() - t0, 2),
        "held_mib": round(held / MiB, 1),
        "peak_growth_mib": round((peak_resident_bytes() - base) / MiB, 1),
        **figures,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--_one", nargs=3, metavar=("FOLDER", "ITEMS", "WHAT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._one:
        folder, items, what = args._one
        print(json.dumps(measure(Path(folder), int(items), what)))
        return 0
    for items in args.items:
        with tempfile.TemporaryDirectory(prefix="explicit-ids-") as tmp:
            write_output(Path(tmp), items)
            for what in ("ids", "contents"):
                done = subprocess.run(
                    [sys.executable, __file__, "--_one", tmp, str(items), what], capture_output=True, text=True
                )
                print(done.stdout.strip() or done.stderr[-2000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
