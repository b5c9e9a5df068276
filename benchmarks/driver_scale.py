"""The driver at scale: memory and CPU per item of a batch job's driver as the manifest grows.

    python benchmarks/driver_scale.py job --items 20000 --format files webdataset   # simulated renderer
    python benchmarks/driver_scale.py job --items 5000 --judge-reject 0 0.3         # judged vs not
    python benchmarks/driver_scale.py plan --items 100000 300000                    # validate + plan only
    python benchmarks/driver_scale.py resume --items 1000000 10000000               # committed set
    python benchmarks/driver_scale.py manifest --items 1000000                      # whole vs chunks
    python benchmarks/driver_scale.py all --out result.json                         # what fits a laptop

Every measurement runs in a fresh Python process, so its peak RSS (Linux VmHWM) is its own:

- ``job``: the real `run_job` with the simulated renderer of benchmarks/orchestration.py (sleeps for GPU
  time, real PNGs, real storing and committing), 4 workers, 25 prompts per reference, a local output,
  ``output.format`` files or webdataset. Reports the driver's peak RSS, its CPU seconds per item (the
  whole driver process: validation, planning, scheduling, committing), wall per item, and the objects
  written per 1,000 images. With ``--judge-reject F`` the job is judged (`judge:` sanity and near_duplicate,
  max_renders_per_item 3) and the simulated renderer draws a black frame for a fraction F of seeds, which the
  sanity check rejects and the loop renders again; the driver's CPU is then reported per manifest item and per
  render (``--judge-reject off`` is the job without a judge: section).
- ``plan``: the planning path without rendering (jobs/spilled_items.py: validate and spill in chunks, mark
  the committed items, read every reference group back), for a manifest written reference-major and prompt-major,
  and as the resume of a finished job (every item already committed).
- ``resume``: a fully committed ledger of N items (metadata parts of 100,000 rows of ids), read back as
  the committed set a resumed job skips: `ledger.committed_item_ids` (a sorted fixed-width numpy array)
  against the Python ``set`` of ``str`` it replaced.
- ``compaction``: `metadata.compact_output_parts` over an output as a job leaves it (benchmarks/report_scale.py's
  parts of 256 wide rows), its time and peak RSS.
- ``manifest``: a CSV manifest read whole (`read_manifest`) against in chunks (`iter_manifest_chunks`).

Prints one JSON object (and writes it to --out).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 2**20


def _peak_rss_mib() -> float:
    """VmHWM, this process's own peak: ru_maxrss would carry the parent's RSS at the fork (Linux keeps it across
    exec)."""
    from snapref_ray.render_service.memory import peak_resident_bytes

    return peak_resident_bytes() / MiB


def _cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _write_manifest(
    folder: Path, items: int, prompts_per_reference: int, max_references: int, order: str = "reference-major"
) -> Path:
    """`items` rows over min(items / prompts, max_references) small generated reference PNGs; `order`
    "reference-major" writes a reference's rows together, "prompt-major" one row per reference in turn (each
    reference's rows spread over the whole file)."""
    from PIL import Image

    references = max(1, min(-(-items // prompts_per_reference), max_references))
    refs = []
    for r in range(references):
        ref = folder / "refs" / f"ref{r:05d}.png"
        ref.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (64, 64), (r % 256, (r // 256) % 256, 120)).save(ref)
        refs.append(ref.relative_to(folder).as_posix())
    manifest = folder / "manifest.csv"
    with open(manifest, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["reference", "prompt", "seed"])
        for i in range(items):
            ref = i % references if order == "prompt-major" else (i // prompts_per_reference) % references
            writer.writerow([refs[ref], f"scene {i % 997}", i])
    return manifest


def _spec(
    manifest: Path,
    out: Path | str,
    models_dir: Path,
    fmt: str,
    workers: int,
    s3: dict | None = None,
    judge: dict | None = None,
):
    from snapref_ray.job_spec import JobSpec

    return JobSpec.model_validate(
        {
            **({"judge": judge} if judge is not None else {}),
            "model": {"models_dir": str(models_dir), "device": "cpu"},
            "manifest": str(manifest),
            "defaults": {"width": 256, "height": 256, "steps": 1, "cfg": 1.0, "sampler": "euler"},
            "output": {"uri": str(out), "format": fmt, "shard_max_items": 10_000, **({"s3": s3} if s3 else {})},
            "cluster": {
                "num_workers": workers,
                "max_batch": 8,
                "max_in_flight_per_worker": 2,
                "num_cpus_per_worker": 1,
            },
        }
    )


# --- one measurement (in its own process) ----------------------------------------------------------


# A judged benchmark job: the weight-free checks (their cost is the workers'; the driver decides near_duplicate).
_JUDGE = {"sanity": {}, "near_duplicate": {"max_distance": -1}, "max_renders_per_item": 3}  # -1: scored, never rejected


def one_job(
    items: int,
    fmt: str,
    workers: int,
    step_s: float,
    where: str = "local",
    order: str = "reference-major",
    reject: str = "off",
) -> dict:
    """The real run_job with simulated workers, then its resume (every item committed: nothing to render).
    `reject`: "off" (no judge: section), else the fraction of renders the simulated renderer makes black."""
    from benchmarks.local_ray import start_local_ray
    from benchmarks.orchestration import SimulatedRenderer
    from benchmarks.s3_server import run_seaweedfs
    from snapref_ray.jobs.generate_dataset import run_job
    from snapref_ray.storage.backends import open_storage
    from snapref_ray.tiny import make_tiny

    with tempfile.TemporaryDirectory(prefix="driver-scale-") as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        s3, out = None, str(root / "out")
        if where == "s3":
            server = stack.enter_context(run_seaweedfs(root / "s3"))
            os.environ.update(server.aws_environment())  # the workers' credentials, as on a cluster's nodes
            s3, out = {"endpoint_url": server.endpoint_url, "region": "us-east-1"}, f"s3://{server.bucket}/job"
        # Logical CPUs for every worker (a 2-core machine stands in for N GPUs), as benchmarks/orchestration.py.
        stack.callback(start_local_ray(num_cpus=workers + 2))
        models = make_tiny(root / "tiny")
        manifest = _write_manifest(root / "in", items, 25, items, order=order)
        judged = reject != "off"
        spec = _spec(manifest, out, models, fmt, workers, s3, judge=_JUDGE if judged else None)
        # A real RefKV is ~1 GB and lives in the object store; 256 KB keeps it there too (Ray inlines returns under
        # 100 KB into the driver's own heap, which real RefKVs never are).
        factory = functools.partial(
            SimulatedRenderer,
            encode_s=0.0,
            step_s=step_s,
            refkv_bytes=256 * 1024,
            image_side=64,
            # Noise, not a flat fill: a flat image is what the sanity check rejects (judged or not, the same images).
            noise_images=True,
            black_fraction=float(reject) if judged else 0.0,
        )
        cpu0, t0 = _cpu_s(), time.time()
        summary = run_job(spec, progress=False, renderer_factory=factory, write_gallery=False)
        cpu, wall = _cpu_s() - cpu0, time.time() - t0
        peak_job = _peak_rss_mib()
        storage = open_storage(out, spec.s3_options())
        by_folder: dict[str, int] = {}
        for key in storage.list(""):
            top = key.split("/", 1)[0] if "/" in key else "."
            by_folder[top] = by_folder.get(top, 0) + 1
        objects = sum(by_folder.values())
        renders = summary.images_this_run
        assert (renders == items or judged) and summary.failed_items == 0, summary
        cpu1, t1 = _cpu_s(), time.time()
        resumed = run_job(spec, progress=False, renderer_factory=factory, write_gallery=False)
        resume_cpu, resume_wall = _cpu_s() - cpu1, time.time() - t1
        assert resumed.images_this_run == 0
    return {
        "items": items,
        "format": fmt,
        "output": where,
        "order": order,
        "workers": workers,
        "gpu_ms_per_batch_of_8": 1000 * step_s,
        "driver_peak_rss_mib": round(peak_job, 1),
        "judge_reject": reject,
        "renders": renders,
        "judge": summary.judge,
        "driver_cpu_ms_per_item": round(1000 * cpu / items, 3),
        "driver_cpu_ms_per_render": round(1000 * cpu / renders, 3),
        "wall_ms_per_item": round(1000 * wall / items, 3),
        "encodes_per_reference": summary.encodes_per_reference,
        "objects_written": objects,
        "objects_per_1000_images": round(1000 * objects / items, 2),
        "objects_by_folder": dict(sorted(by_folder.items())),
        "resume_wall_s": round(resume_wall, 2),
        "resume_driver_cpu_s": round(resume_cpu, 2),
        "resume_peak_rss_mib": round(_peak_rss_mib(), 1),
    }


def one_plan(items: int, order: str = "reference-major", committed: str = "none") -> dict:
    """The driver's planning path (what run_job does before a worker starts, and what it reads back while the
    schedule runs): validate the manifest in chunks and spill it, mark what an earlier run committed, then read
    every reference group back as the schedule would. `committed`: "none", or "all" (a finished job's resume:
    every id in the output's ledger)."""
    from snapref_ray.jobs.manifest_check import ManifestSettings
    from snapref_ray.jobs.spilled_items import SpilledItems
    from snapref_ray.storage.ledger import CommittedIds
    from snapref_ray.tiny import make_tiny

    with tempfile.TemporaryDirectory(prefix="driver-scale-") as tmp:
        root = Path(tmp)
        manifest = _write_manifest(root / "in", items, 25, max(1, items // 25), order=order)
        spec = _spec(manifest, root / "out", make_tiny(root / "tiny"), "files", 4)
        base = _peak_rss_mib()
        cpu0, t0 = _cpu_s(), time.time()
        plan = SpilledItems.build(ManifestSettings.of(spec), adapter_kind="snapref")
        t_validated = time.time()
        done = CommittedIds.from_strings([])
        if committed == "all":
            done = CommittedIds.from_arrow_parts(_plan_ids(plan))
        elif committed == "ledger":  # a finished job's output: its metadata parts hold every id; read them back
            from snapref_ray.storage.backends import open_storage
            from snapref_ray.storage.ledger import committed_item_ids

            ledger = open_storage(str(root / "ledger"))
            _write_ledger_parts(ledger, _plan_ids(plan))
            t_validated = time.time()
            done = committed_item_ids(ledger)
        t_ledger = time.time()
        plan.skip_committed(done)
        groups = read = 0
        for group in plan.reference_groups():
            groups += 1
            read += len(group)
        cpu, wall = _cpu_s() - cpu0, time.time() - t0
        assert plan.items == items and read == plan.to_render, (plan.items, read, plan.errors_head[:3])
        plan.close()
    return {
        "items": items,
        "order": order,
        "committed": committed,
        "to_render": plan.to_render,
        "references": plan.references_to_render if committed == "none" else None,
        "groups_read": groups,
        "peak_rss_mib": round(_peak_rss_mib(), 1),
        "rss_growth_mib": round(_peak_rss_mib() - base, 1),
        "rss_growth_bytes_per_item": round(2**20 * (_peak_rss_mib() - base) / items, 1),
        "cpu_ms_per_item": round(1000 * cpu / items, 4),
        "validate_s": round(t_validated - t0, 1),
        "ledger_s": round(t_ledger - t_validated, 1),
        "wall_s": round(wall, 1),
    }


def _write_ledger_parts(storage, id_columns) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for n, ids in enumerate(id_columns):
        buf = io.BytesIO()
        pq.write_table(pa.table({"item_id": ids}), buf)
        storage.put_bytes(f"metadata/part-20260101T000000{n:012d}Z-bench.parquet", buf.getvalue())


def _plan_ids(plan):
    """The plan's item ids, a run at a time (a stand-in for a finished job's ledger, without writing one)."""
    import pyarrow as pa

    for run in plan.runs:
        with pa.OSFile(str(run.path)) as source:
            yield pa.ipc.open_file(source).read_all().column("item_id").combine_chunks()


def _committed_ledger(storage, items: int, rows_per_part: int) -> None:
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    for start in range(0, items, rows_per_part):
        end = min(items, start + rows_per_part)
        ids = [hashlib.sha256(str(i).encode()).hexdigest()[:20] for i in range(start, end)]
        buf = io.BytesIO()
        pq.write_table(pa.table({"item_id": ids}), buf)
        storage.put_bytes(f"metadata/part-20260101T000000{start:012d}Z-bench.parquet", buf.getvalue())


def one_resume(items: int, how: str) -> dict:
    from snapref_ray.storage.backends import open_storage
    from snapref_ray.storage.ledger import committed_item_ids
    from snapref_ray.storage.metadata import read_item_ids

    with tempfile.TemporaryDirectory(prefix="driver-scale-") as tmp:
        storage = open_storage(tmp)
        _committed_ledger(storage, items, 100_000)
        base = _peak_rss_mib()
        cpu0, t0 = _cpu_s(), time.time()
        done = committed_item_ids(storage) if how == "compact" else set(read_item_ids(storage))
        cpu, wall = _cpu_s() - cpu0, time.time() - t0
        assert len(done) == items
        probe = time.time()
        hits = sum(1 for i in range(0, items, max(1, items // 100_000)) if f"{i:020x}" in done)
        probe_us = 1e6 * (time.time() - probe) / len(range(0, items, max(1, items // 100_000)))
    return {
        "items": items,
        "committed_set": how,
        "build_s": round(wall, 2),
        "build_cpu_s": round(cpu, 2),
        "peak_rss_mib": round(_peak_rss_mib(), 1),
        "rss_growth_mib": round(_peak_rss_mib() - base, 1),
        "held_mib": round(done.nbytes / MiB, 1) if how == "compact" else None,
        "lookup_us": round(probe_us, 2),
        "hits": hits,
    }


def one_compaction(items: int) -> dict:
    """`compact_output_parts` over an output of `items` items as a job leaves it (benchmarks/report_scale.py's:
    metadata parts of 256 rows from 4 workers, every column filled), in this process: its time and peak RSS."""
    from benchmarks.report_scale import write_output
    from snapref_ray.storage.backends import open_storage
    from snapref_ray.storage.metadata import compact_output_parts

    with tempfile.TemporaryDirectory(prefix="driver-scale-") as tmp:
        write_output(Path(tmp) / "out", items, "files")
        storage = open_storage(str(Path(tmp) / "out"))
        before = len(storage.list("metadata/"))
        from snapref_ray.render_service.memory import reset_peak_resident

        reset_peak_resident()  # the output's writing is not the compaction's
        t0 = time.time()
        compact_output_parts(storage)
        return {
            "items": items,
            "parts_before": before,
            "parts_after": len(storage.list("metadata/")),
            "seconds": round(time.time() - t0, 2),
            "peak_rss_mib": round(_peak_rss_mib(), 1),
        }


def one_manifest(items: int, how: str) -> dict:
    from snapref_ray.storage.manifest import iter_manifest_chunks, read_manifest

    with tempfile.TemporaryDirectory(prefix="driver-scale-") as tmp:
        manifest = _write_manifest(Path(tmp), items, 25, 100)
        base = _peak_rss_mib()
        t0 = time.time()
        if how == "whole":
            rows = len(read_manifest(str(manifest)))
        else:
            rows = sum(len(c) for c in iter_manifest_chunks(str(manifest), chunk_rows=50_000))
        assert rows == items
    return {
        "items": items,
        "read": how,
        "seconds": round(time.time() - t0, 2),
        "rss_growth_mib": round(_peak_rss_mib() - base, 1),
    }


# --- the runs -------------------------------------------------------------------------------------------


def _in_process(*args: str) -> dict:
    """One measurement in a fresh interpreter (its own peak RSS)."""
    out = subprocess.run(
        [sys.executable, __file__, "_one", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    result = {"args": args, "error": out.stderr[-2000:]} if out.returncode else json.loads(out.stdout.splitlines()[-1])
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["job", "plan", "resume", "manifest", "compaction", "all", "_one"])
    parser.add_argument("--items", type=int, nargs="*", default=None)
    parser.add_argument("--format", nargs="*", default=["files", "webdataset"])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--output",
        nargs="*",
        default=["local"],
        choices=["local", "s3"],
        help="job output: a local folder, or SeaweedFS on 127.0.0.1",
    )
    parser.add_argument("--order", default="reference-major", choices=["reference-major", "prompt-major"])
    parser.add_argument(
        "--step-s",
        type=float,
        default=0.05,
        help="simulated GPU seconds per batch (1 step): 0 measures the driver flat out, but then workers "
        "idle between calls and close their shards early",
    )
    parser.add_argument(
        "--judge-reject",
        nargs="*",
        default=["off"],
        help="job: 'off' (no judge: section), or the fraction of renders the judge rejects (the simulated renderer"
        " draws them black); one job per value",
    )
    parser.add_argument("--out")
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args(argv)
    if args.what == "_one":
        kind, *params = args.rest
        fn = {
            "job": lambda n, f, where, order, reject: one_job(
                int(n), f, args.workers, args.step_s, where, order, reject
            ),
            "plan": lambda n, order, committed: one_plan(int(n), order, committed),
            "resume": lambda n, how: one_resume(int(n), how),
            "manifest": lambda n, how: one_manifest(int(n), how),
            "compaction": lambda n: one_compaction(int(n)),
        }[kind]
        print(json.dumps(fn(*params)))
        return 0
    runs: list[dict] = []
    todo = ["job", "plan", "resume", "manifest", "compaction"] if args.what == "all" else [args.what]
    for what in todo:
        if what == "job":
            for n in args.items or [20_000]:
                runs += [
                    _in_process(
                        "job",
                        str(n),
                        f,
                        where,
                        args.order,
                        reject,
                        "--workers",
                        str(args.workers),
                        "--step-s",
                        str(args.step_s),
                    )
                    for where in args.output
                    for f in args.format
                    for reject in args.judge_reject
                ]
        elif what == "plan":
            for n in args.items or [100_000, 1_000_000]:
                runs += [_in_process("plan", str(n), order, "none") for order in ("reference-major", "prompt-major")]
                runs.append(_in_process("plan", str(n), "reference-major", "all"))
        elif what == "resume":
            for n in args.items or [1_000_000, 10_000_000]:
                runs += [_in_process("resume", str(n), how) for how in ("compact", "python-set")]
        elif what == "manifest":
            for n in args.items or [1_000_000]:
                runs += [_in_process("manifest", str(n), how) for how in ("whole", "chunks")]
        elif what == "compaction":
            runs += [_in_process("compaction", str(n)) for n in args.items or [1_000_000]]
    result = {"machine": f"{os.cpu_count()} cores", "runs": runs}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
