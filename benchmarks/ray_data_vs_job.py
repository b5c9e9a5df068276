"""The job runner (`snapref-ray render`) against a Ray Data pipeline, with and without grouping by reference.

    python benchmarks/ray_data_vs_job.py [--workers 2] [--references 12] [--prompts 8] [--out result.json]
    python benchmarks/ray_data_vs_job.py --smoke

One manifest, rendered three ways on the same local Ray with the same number of workers:

- `job`: `run_job` (what `snapref-ray render` runs): validation, reference-affine scheduling, one
  encode per reference handed to the other workers through the object store, PNGs + thumbnails +
  Parquet metadata written to a folder.
- `ray_data_ungrouped`: `read_csv -> repartition -> map_batches(SnapRefRenderer) -> write_parquet`
  on the manifest as it is.
- `ray_data_grouped`: the same with `sort("reference")` first (what the README tells users to do).

The manifest is written prompt-major (every reference's first prompt, then every reference's second,
...), as a prompts table joined with a characters table often comes out. The GPU is simulated as
in benchmarks/orchestration.py (`SimulatedRenderer`: an encode sleeps `--encode-s`, a batched
forward `--steps` x `--step-s`), except that each extra image of a batch adds `--row-cost` of a
single image's time (a GPU batch of 4 is cheaper than 4 singles, not free). Each worker's RefKV
LRU holds `--cache-refs` references, as an 8 GiB budget holds ~8 real 1 MP RefKVs.

Per runner: wall seconds from the call to the outputs written (worker start included) and images/s
over it; the rendering span (first batch started to last image finished, from the rows' own
started_at / finished_at) and images/s over that, which leaves start-up out; reference encodes per
reference (mean and max); for Ray Data the batched forwards and the mean images per forward.
Prints one JSON object (and writes it to --out).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from benchmarks.local_ray import start_local_ray  # noqa: E402
from benchmarks.orchestration import SimulatedRenderer  # noqa: E402

RUNNERS = ("job", "ray_data_ungrouped", "ray_data_grouped")
FIELDS = (
    "runner",
    "images",
    "failed",
    "wall_s",
    "images_per_s",
    "render_span_s",
    "rendering_images_per_s",
    "reference_encodes",
    "encodes_per_reference",
    "max_encodes_per_reference",
)
RAY_DATA_FIELDS = ("forwards", "images_per_forward", "actors")


class BatchCostRenderer(SimulatedRenderer):
    """SimulatedRenderer whose batched forward costs steps x step_s x (1 + (n - 1) x row_cost)."""

    def __init__(self, config, *, row_cost: float, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.row_cost = row_cost

    def render(self, requests, **kwargs):
        extra = (len(requests) - 1) * self.row_cost * requests[0].settings.steps * self.step_s
        time.sleep(extra)
        return super().render(requests, **kwargs)


def write_manifest(folder: Path, references: int, prompts: int) -> Path:
    """Prompt-major rows (references interleaved), absolute reference paths (Ray workers' cwd differs)."""
    from PIL import Image

    paths = []
    for r in range(references):
        path = folder / "refs" / f"ref{r:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (64, 64), (r * 37 % 256, r * 91 % 256, 120)).save(path)
        paths.append(str(path))
    manifest = folder / "manifest.csv"
    with open(manifest, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["reference", "prompt", "seed"])
        writer.writeheader()
        writer.writerows(
            {"reference": paths[r], "prompt": f"1girl, scene {p}", "seed": 1000 * r + p}
            for p in range(prompts)
            for r in range(references)
        )
    return manifest


def _settings(args) -> dict:
    return {"width": 256, "height": 256, "steps": args.steps, "cfg": 1.0, "sampler": "euler"}


def _factory(args):
    refkv_bytes = args.refkv_kib * 1024
    return functools.partial(
        BatchCostRenderer,
        row_cost=args.row_cost,
        encode_s=args.encode_s,
        step_s=args.step_s,
        refkv_bytes=refkv_bytes,
        image_side=args.image_side,
    )


def _cache_bytes(args) -> int:
    # The simulated RefKV is [2, 2, 1, tokens, 64] bf16 for tokens = refkv_bytes // 256: its nbytes, plus slack.
    return args.cache_refs * args.refkv_kib * 1024 + 1024


def _span(table) -> dict:
    """From the first batch's start to the last image's finish (per-row started_at / finished_at, the same
    columns in job metadata and SnapRefRenderer output): the rendering phase, worker start-up excluded."""
    import pyarrow.compute as pc

    span = pc.max(table.column("finished_at")).as_py() - pc.min(table.column("started_at")).as_py()
    return {"render_span_s": round(span, 3), "rendering_images_per_s": round(table.num_rows / span, 3)}


def run_job_runner(manifest: Path, models_dir: Path, out: Path, args) -> dict:
    import pyarrow.parquet as pq

    from snapref_ray.job_spec import JobSpec
    from snapref_ray.jobs.generate_dataset import run_job

    spec = JobSpec.model_validate(
        {
            "model": {"models_dir": str(models_dir), "device": "cpu"},
            "manifest": str(manifest),
            "defaults": _settings(args),
            "output": {"uri": str(out)},
            "cluster": {
                "num_workers": args.workers,
                "max_batch": args.max_batch,
                "refkv_cache_bytes": _cache_bytes(args),
                "num_cpus_per_worker": 1,
            },
        }
    )
    t0 = time.perf_counter()
    summary = run_job(spec, progress=False, renderer_factory=_factory(args), write_gallery=False)
    wall = time.perf_counter() - t0
    return {
        "runner": "job",
        "images": summary.images_this_run,
        "failed": summary.failed_items,
        "wall_s": round(wall, 3),
        "images_per_s": round(summary.images_this_run / wall, 3),
        "reference_encodes": summary.reference_encodes,
        "encodes_per_reference": round(summary.encodes_per_reference, 3),
        "max_encodes_per_reference": summary.max_encodes_per_reference,
        "render_seconds": round(summary.render_seconds, 3),
        **_span(pq.read_table(str(out / "metadata"), columns=["started_at", "finished_at"])),
    }


def run_ray_data(manifest: Path, models_dir: Path, out: Path, args, *, grouped: bool) -> dict:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import ray

    from snapref_ray.data import SnapRefRenderer

    t0 = time.perf_counter()
    ds = ray.data.read_csv(str(manifest))
    if grouped:
        ds = ds.sort("reference")
    ds = ds.repartition(target_num_rows_per_block=args.rows_per_block).map_batches(
        SnapRefRenderer,
        fn_constructor_kwargs={
            "model": {"models_dir": str(models_dir), "device": "cpu"},
            "defaults": _settings(args),
            "max_batch": args.max_batch,
            "refkv_cache_bytes": _cache_bytes(args),
            "renderer_factory": _factory(args),
        },
        compute=ray.data.ActorPoolStrategy(size=args.workers),
        num_cpus=1,
        batch_size=args.max_batch,
        udf_modifying_row_count=False,
    )
    ds.write_parquet(str(out))
    wall = time.perf_counter() - t0
    table = pq.read_table(
        str(out),
        columns=["reference", "worker_id", "batch_id", "refkv_cache_hit", "error", "started_at", "finished_at"],
    )
    rows = [r for r in table.to_pylist() if r["error"] is None]
    forwards = {r["batch_id"] for r in rows}
    # A forward that missed the cache encoded its reference on its actor: encodes per reference.
    encodes = Counter(ref for ref, _ in {(r["reference"], r["batch_id"]) for r in rows if not r["refkv_cache_hit"]})
    references = len({r["reference"] for r in rows})
    return {
        "runner": "ray_data_grouped" if grouped else "ray_data_ungrouped",
        "images": len(rows),
        "failed": table.num_rows - len(rows),
        "wall_s": round(wall, 3),
        "images_per_s": round(len(rows) / wall, 3),
        "reference_encodes": sum(encodes.values()),
        "encodes_per_reference": round(sum(encodes.values()) / max(1, references), 3),
        "max_encodes_per_reference": max(encodes.values(), default=0),
        "forwards": len(forwards),
        **_span(table.filter(pc.is_null(table.column("error")))),
        "images_per_forward": round(len(rows) / max(1, len(forwards)), 3),
        "actors": len({r["worker_id"] for r in rows}),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="job workers = Ray Data actors")
    p.add_argument("--references", type=int, default=12)
    p.add_argument("--prompts", type=int, default=8, help="prompts per reference")
    p.add_argument("--encode-s", type=float, default=0.5, help="simulated GPU seconds per reference encode")
    p.add_argument("--step-s", type=float, default=0.025, help="simulated GPU seconds per sampling step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--row-cost",
        type=float,
        default=0.5,
        help="extra cost of each further image in a batch, as a fraction of a single image's",
    )
    p.add_argument("--max-batch", type=int, default=4, help="job max_batch = Ray Data batch_size and max_batch")
    p.add_argument("--rows-per-block", type=int, default=8, help="Ray Data repartition(target_num_rows_per_block)")
    p.add_argument("--cache-refs", type=int, default=4, help="RefKVs each worker's LRU holds")
    p.add_argument("--refkv-kib", type=int, default=256, help="size of each simulated RefKV")
    p.add_argument("--image-side", type=int, default=64)
    p.add_argument("--smoke", action="store_true", help="tiny sizes and sleeps: checks the script runs end to end")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.references, args.prompts, args.steps, args.step_s, args.encode_s = 3, 4, 2, 0.005, 0.05
        args.rows_per_block, args.cache_refs = 4, 2

    import logging

    logging.basicConfig(level=logging.WARNING)
    import ray

    from snapref_ray.tiny import make_tiny

    root = Path(tempfile.mkdtemp(prefix="snapref-ray-data-vs-job-"))
    stop_ray = None  # set when this call starts the Ray it runs on
    try:
        models_dir = make_tiny(root / "tiny-models")  # the job spec resolves a models folder; the GPU is simulated
        manifest = write_manifest(root, args.references, args.prompts)
        if not ray.is_initialized():
            stop_ray = start_local_ray(num_cpus=args.workers + 2)
        ray.data.DataContext.get_current().enable_progress_bars = False
        runs = [run_job_runner(manifest, models_dir, root / "job", args)]
        for grouped in (False, True):
            name = "grouped" if grouped else "ungrouped"
            runs.append(run_ray_data(manifest, models_dir, root / name, args, grouped=grouped))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    finally:
        if stop_ray is not None:
            stop_ray()
        shutil.rmtree(root, ignore_errors=True)
    by = {r["runner"]: r for r in runs}
    result = {
        "benchmark": "ray_data_vs_job",
        "command": "python benchmarks/ray_data_vs_job.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "ray": ray.__version__,
            "platform": platform.platform(),
        },
        "params": {k: v for k, v in vars(args).items() if k != "out"},
        "simulated_gpu_seconds": {"encode": args.encode_s, "single_image_forward": round(args.steps * args.step_s, 4)},
        "runs": runs,
        "ratios": {
            f"{a}_vs_{b}_{field}": round(by[a][field] / by[b][field], 3)
            for a, b in (("job", "ray_data_grouped"), ("ray_data_grouped", "ray_data_ungrouped"))
            for field in ("images_per_s", "rendering_images_per_s")
        },
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
