"""Orchestration benchmark: the batch job machinery with simulated GPUs, N = 1, 2, 4, 8, 16 workers.

    python benchmarks/orchestration.py [--workers 1,2,4,8,16] [--out result.json] [--no-startup]
    python benchmarks/orchestration.py --workers 1 --prompts 8 --overlap both --output s3 --image-side 1024 \
        --noise-images --no-startup          # busy fraction with / without the output overlap
    python benchmarks/orchestration.py --smoke   # tiny: 1 worker, overlap on and off, S3 (what the test runs)

Runs the real job (`run_job` -> `start_workers` -> `RenderWorker` actors -> `BatchScheduler`,
images and Parquet written to a local folder) with a `renderer_factory` whose "GPU time" is a
fixed sleep: `encode_reference` sleeps `--encode-s` and returns a small real RefKV,
`render` sleeps steps x `--step-s` and returns small PIL images. So a 2-core machine can stand in
for 16 GPUs: what is measured is the orchestration (scheduling, object-store hand-off, storing,
committing), not the model. The job grows with N (`--batches-per-worker` batches of `--max-batch`
images per worker; `--prompts` prompts per reference), so every N does the same work per worker.

Per N it reports: throughput (images/s over the scheduling phase, `summary.render_seconds`)
against the ideal N x the single-worker throughput; how busy the workers were (simulated GPU
seconds / (N x wall)); driver CPU per image (process CPU time of the driver during the
scheduling phase, the sampler thread's own CPU subtracted); peak object-store bytes; peak driver
RSS; encodes per reference. Separately (unless --no-startup) it times `snapref-ray render` on the
tiny models from the command to the first image on disk (start-up cost: Ray, workers, models).

Object-store figure: `ray._private.internal_api.get_memory_info_reply(...)
.store_stats.object_store_bytes_used`, the plasma bytes in use summed over the cluster's raylets
(what `ray memory --stats-only` prints), sampled every 0.2 s; works in Ray 2.60 without the
dashboard. (`ray.available_resources()["object_store_memory"]` does not move with usage: it is a
scheduling resource.)

Output overlap (`--overlap on|off|both`): `on` is the worker's default, images encoded and
uploaded on its output threads (`snapref_ray/cluster/output_writer.py`, `cluster.output_threads`)
while the next batch samples; `off` (`output_threads: 0`) stores them inline while the device
waits. `--output s3` writes to a SeaweedFS S3 server started for the run (benchmarks/s3_server.py),
`--noise-images` returns images with noise in them so PNG encoding costs what a real render's
does (a flat image compresses to nothing). Each run reports `output_overlap` and `workers_busy`.

Prints one JSON object (and writes it to --out if given).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import hashlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

MiB = 2**20


# --- the simulated GPU --------------------------------------------------------------------------


class SimulatedAdapter:
    identity = "simulated-adapter"


class SimulatedRenderer:
    """Renderer's interface (encode_reference, render, device, model_id, load_seconds) with sleeps.

    The RefKV is real (a tensor of `refkv_bytes`, so the object store sees realistic traffic for
    its size) and the images are real PIL images (small: PNG encoding is worker CPU, not GPU).
    """

    def __init__(
        self,
        config,
        *,
        encode_s: float,
        step_s: float,
        refkv_bytes: int,
        image_side: int,
        noise_images: bool = False,
        black_fraction: float = 0.0,
    ) -> None:
        import torch
        from PIL import Image

        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.model_id = "simulated"
        self.load_seconds = 0.0
        self.compiled = False
        self.adapter = SimulatedAdapter()
        self.adapter_kind = "snapref"
        self.encode_s, self.step_s, self.refkv_bytes, self.image_side = encode_s, step_s, refkv_bytes, image_side
        # A judged job's rejects (benchmarks/driver_scale.py --judge-reject): this fraction of seeds (by a hash of
        # the seed, so a re-render's new seed draws again) renders a black frame, which the sanity check rejects.
        self.black_fraction = black_fraction
        # Made once here, not per render: only the sleep stands for device time.
        size = (image_side, image_side)
        self.noise = (
            [Image.merge("RGB", [Image.effect_noise(size, sigma) for sigma in (24 + k, 40, 56)]) for k in range(4)]
            if noise_images
            else None
        )

    def encode_reference(
        self, images, *, layout="single", ref_caption="", ref_megapixels=1.0, width=1024, height=1024, sources=None
    ):
        import torch

        from snapref_ray.adapter.refkv import RefKV
        from snapref_ray.geometry import token_grid

        time.sleep(self.encode_s)
        digest = hashlib.sha256(b"".join(images)).hexdigest()[:32]
        tokens = max(1, self.refkv_bytes // (2 * 2 * 64 * 2))  # [blocks=2, K/V, heads=1, tokens, 64] bf16
        kv = torch.zeros((2, 2, 1, tokens, 64), dtype=torch.bfloat16)
        return RefKV(
            kv,
            ((1, 1, 1),),
            ((0, 0, 0),),
            (1, *token_grid(height=height, width=width)),
            "simulated-adapter",
            digest,
            self.encode_s,
        )

    def resolve(self, settings):
        from snapref_ray.adapter.controls import resolve_settings

        return resolve_settings(settings, self.adapter_kind)

    def render(self, requests, *, refkv=None, references=None, layout="single", init_image=None, progress=None):
        from PIL import Image

        from snapref_ray.engine import RenderResult

        steps = requests[0].settings.steps
        time.sleep(steps * self.step_s)
        side = self.image_side
        images = (
            [self.noise[r.seed % len(self.noise)].copy() for r in requests]
            if self.noise
            else [Image.new("RGB", (side, side), (r.seed % 256, 40, 90)) for r in requests]
        )
        for i, r in enumerate(requests):
            if self.black_fraction and zlib.crc32(str(r.seed).encode()) % 10_000 < self.black_fraction * 10_000:
                images[i] = Image.new("RGB", (side, side), (0, 0, 0))
        return [
            RenderResult(image, r, {"sample_s": steps * self.step_s, "decode_s": 0.0, "encode_s": 0.0})
            for image, r in zip(images, requests)
        ]


# --- measurement --------------------------------------------------------------------------------


def _store_bytes_used() -> int:
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return int(reply.store_stats.object_store_bytes_used)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Sampler:
    """Peak RSS (every 20 ms) and object-store bytes (every 0.2 s) from a thread; its own CPU is kept apart."""

    def __init__(self) -> None:
        from snapref_ray.render_service.memory import resident_bytes

        self._resident_bytes = resident_bytes
        self.peak_rss = resident_bytes()
        self.peak_store = 0
        self.own_cpu = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.thread_time()
        last_store = 0.0
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, self._resident_bytes())
            if time.monotonic() - last_store >= 0.2:
                try:
                    self.peak_store = max(self.peak_store, _store_bytes_used())
                except Exception:
                    pass
                last_store = time.monotonic()
            time.sleep(0.02)
        self.own_cpu = time.thread_time() - t0

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


# --- one run ------------------------------------------------------------------------------------


def _write_job(folder: Path, references: int, prompts: int) -> Path:
    from PIL import Image

    rows = []
    for r in range(references):
        ref = folder / "refs" / f"ref{r:04d}.png"
        ref.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (64, 64), (r % 256, (r // 256) % 256, 120)).save(ref)
        rows += [
            {"reference": ref.relative_to(folder).as_posix(), "prompt": f"scene {p}", "seed": r * 1000 + p}
            for p in range(prompts)
        ]
    manifest = folder / "manifest.csv"
    with open(manifest, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["reference", "prompt", "seed"])
        writer.writeheader()
        writer.writerows(rows)
    return manifest


def run_one(workers: int, prompts: int, args, models_dir: Path, root: Path, *, overlap: bool = True, s3=None) -> dict:
    from snapref_ray.job_spec import JobSpec
    from snapref_ray.jobs.generate_dataset import run_job
    from snapref_ray.render_service.memory import resident_bytes

    references = -(-workers * args.batches_per_worker * args.max_batch // prompts)
    images = references * prompts
    folder = root / f"n{workers}-p{prompts}-{'overlap' if overlap else 'inline'}"
    manifest = _write_job(folder, references, prompts)
    spec = JobSpec.model_validate(
        {
            "model": {"models_dir": str(models_dir), "device": "cpu"},
            "manifest": str(manifest),
            "defaults": {"width": 256, "height": 256, "steps": args.steps, "cfg": 1.0, "sampler": "euler"},
            "output": (
                {"uri": str(folder / "out")}
                if s3 is None
                else {
                    "uri": f"s3://{s3.bucket}/{folder.name}-{time.time_ns()}",
                    "s3": {"endpoint_url": s3.endpoint_url, "region": "us-east-1"},
                }
            ),
            "cluster": {
                "num_workers": workers,
                "max_batch": args.max_batch,
                "max_in_flight_per_worker": args.in_flight,
                "num_cpus_per_worker": 1,
                "output_threads": args.output_threads if overlap else 0,
            },
        }
    )
    factory = functools.partial(
        SimulatedRenderer,
        encode_s=args.encode_s,
        step_s=args.step_s,
        refkv_bytes=args.refkv_kib * 1024,
        image_side=args.image_side,
        noise_images=args.noise_images,
    )
    marks: dict[str, float] = {}

    def workers_ready(handles, infos) -> None:
        marks["cpu0"] = _cpu_seconds()
        marks["ready"] = time.time()

    # The raylet frees released objects in batches (up to ~1 s later): let the previous run's go
    # so that this run's peak is its own.
    deadline = time.monotonic() + 10
    while _store_bytes_used() > MiB // 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    rss_before = resident_bytes()
    with Sampler() as sampler:
        summary = run_job(spec, progress=False, renderer_factory=factory, write_gallery=False, on_workers=workers_ready)
        cpu = _cpu_seconds() - marks["cpu0"]
    sched = summary.scheduler
    gpu_seconds = sched["dispatched_batches"] * args.steps * args.step_s + sched["reference_encodes"] * args.encode_s
    render_s = summary.render_seconds
    done = summary.images_this_run
    assert done == images and summary.failed_items == 0, summary
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "workers": workers,
        "prompts_per_reference": prompts,
        "output_overlap": overlap,
        "output": "s3" if s3 is not None else "local",
        "images": done,
        "references": references,
        "batches": sched["dispatched_batches"],
        "render_seconds": round(render_s, 3),
        "worker_start_seconds": round(summary.startup_seconds, 2),
        "images_per_s": round(done / render_s, 3),
        "workers_busy": round(gpu_seconds / (workers * render_s), 4),
        "driver_cpu_ms_per_image": round(1000 * max(0.0, cpu - sampler.own_cpu) / done, 3),
        "peak_object_store_mib": round(sampler.peak_store / MiB, 2),
        "peak_driver_rss_mib": round(sampler.peak_rss / MiB, 1),
        "driver_rss_before_mib": round(rss_before / MiB, 1),
        "encodes_per_reference": summary.encodes_per_reference,
        "max_encodes_per_reference": summary.max_encodes_per_reference,
        "object_store_fetches": sched["fetches"],
        "peak_open_references": sched["peak_open_references"],
    }


# --- start-up: `snapref-ray render` to the first image -----------------------------------------------


def time_to_first_image(models_dir: Path, root: Path) -> dict:
    from PIL import Image

    folder = root / "startup"
    refs = folder / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (128, 160), (200, 60, 60)).save(refs / "a.png")
    manifest = folder / "manifest.csv"
    manifest.write_text("reference,prompt\n" + "".join(f"refs/a.png,scene {i}\n" for i in range(4)))
    out = folder / "out"
    exe = shutil.which("snapref-ray")
    base = [exe] if exe else [sys.executable, "-m", "snapref_ray.cli"]
    command = base + [
        "render",
        str(manifest),
        "--models",
        str(models_dir),
        "--out",
        str(out),
        "--workers",
        "2",
        "--no-progress",
        "--width",
        "256",
        "--height",
        "256",
        "--steps",
        "2",
        "--cfg",
        "1",
        "--sampler",
        "euler",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    t0 = time.monotonic()
    first = None
    with open(folder / "render.log", "wb") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if first is None and (out / "images").is_dir() and any((out / "images").glob("*.png")):
                first = time.monotonic() - t0
            time.sleep(0.02)
        total = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{(folder / 'render.log').read_text()[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "command": " ".join(["snapref-ray" if exe else "python -m snapref_ray.cli"] + command[len(base) :]),
        "seconds_to_first_image": round(first if first is not None else total, 2),
        "seconds_total": round(total, 2),
        "images": summary["images_this_run"],
        "job_startup_seconds": summary["startup_seconds"],
        "job_render_seconds": summary["render_seconds"],
    }


# --- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,2,4,8,16", help="worker counts, comma-separated")
    p.add_argument("--step-s", type=float, default=0.025, help="simulated GPU seconds per sampling step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--encode-s", type=float, default=0.1, help="simulated GPU seconds per reference encode")
    p.add_argument("--max-batch", type=int, default=2)
    p.add_argument("--in-flight", type=int, default=2, help="max_in_flight_per_worker")
    p.add_argument("--batches-per-worker", type=int, default=32)
    p.add_argument(
        "--prompts",
        default="8,128",
        help="prompts per reference, comma-separated: one scenario each (8: about two references per "
        "worker, each encoded where it is sampled; 128: fewer references than workers, so most "
        "workers read a RefKV another one encoded from the object store)",
    )
    p.add_argument("--refkv-kib", type=int, default=1024, help="size of each simulated RefKV")
    p.add_argument("--image-side", type=int, default=64, help="side of the returned images (PNG work per image)")
    p.add_argument(
        "--noise-images",
        action="store_true",
        help="images with noise in them (PNG encoding costs what a real render's does)",
    )
    p.add_argument(
        "--overlap",
        choices=("on", "off", "both"),
        default="on",
        help="output overlap: on = output threads (the default worker), off = stores inline, both = each",
    )
    p.add_argument("--output-threads", type=int, default=4, help="output threads per worker when overlapping")
    p.add_argument(
        "--output",
        choices=("local", "s3"),
        default="local",
        help="local folder, or a SeaweedFS S3 server started for the run",
    )
    p.add_argument("--no-startup", action="store_true", help="skip timing `snapref-ray render` to the first image")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny and quick: 1 worker, 8 prompts, 2 batches of 2, 2 steps, overlap on and off, S3, "
        "no start-up timing (what tests/benchmarks runs)",
    )
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.workers, args.prompts, args.batches_per_worker, args.max_batch = "1", "8", 2, 2
        args.steps, args.step_s, args.encode_s, args.refkv_kib = 2, 0.01, 0.01, 64
        args.overlap, args.output, args.no_startup, args.noise_images = "both", "s3", True, True
    counts = [int(n) for n in args.workers.split(",")]
    scenarios = [int(n) for n in args.prompts.split(",")]

    import logging

    logging.basicConfig(level=logging.WARNING)
    import ray

    from benchmarks.local_ray import start_local_ray
    from snapref_ray.tiny import make_tiny

    overlaps = {"on": [True], "off": [False], "both": [True, False]}[args.overlap]
    root = Path(tempfile.mkdtemp(prefix="snapref-orchestration-"))
    s3_context = contextlib.nullcontext()
    if args.output == "s3":
        sys.path.insert(0, str(REPO))
        from benchmarks.s3_server import run_seaweedfs

        s3_context = run_seaweedfs(root / "seaweedfs")
    try:
        models_dir = make_tiny(root / "tiny-models")
        with s3_context as s3:
            # Job specs carry no credentials: the driver and the workers take them from the AWS environment.
            credentials = {}
            if s3 is not None:
                credentials = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
            # More logical CPUs than workers: each worker reserves one; the driver and Ray need none.
            stop_ray = start_local_ray(credentials, num_cpus=max(counts) + 2)
            runs = []
            try:
                # A small job first, not reported: the first job in a driver pays one-off imports
                # (pyarrow's Parquet writer, boto3, ...) that would be charged to N = 1. The smoke run
                # only checks that every figure is made, so it skips the warm-up.
                if not args.smoke:
                    run_one(
                        1,
                        scenarios[0],
                        argparse.Namespace(**{**vars(args), "batches_per_worker": 2}),
                        models_dir,
                        root,
                        s3=s3,
                    )
                for prompts in scenarios:
                    for n in counts:
                        for overlap in overlaps:  # side by side, so load drift hits both alike
                            runs.append(run_one(n, prompts, args, models_dir, root, overlap=overlap, s3=s3))
                            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
            finally:
                stop_ray()  # and the caller's environment as it was (the smoke test runs in-process)
        for prompts in scenarios:
            group = [r for r in runs if r["prompts_per_reference"] == prompts]
            single = next(
                (r["images_per_s"] for r in group if r["workers"] == 1 and r["output_overlap"] == overlaps[0]), None
            )
            for r in group:
                if single:
                    r["ideal_images_per_s"] = round(r["workers"] * single, 3)
                    r["efficiency_vs_ideal"] = round(r["images_per_s"] / r["ideal_images_per_s"], 4)
        result = {
            "benchmark": "orchestration",
            "command": "python benchmarks/orchestration.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "ray": ray.__version__,
                "platform": platform.platform(),
            },
            "params": {k: v for k, v in vars(args).items() if k not in ("out",)},
            "gpu_seconds_per_batch": round(args.steps * args.step_s, 4),
            "object_store_metric": "get_memory_info_reply().store_stats.object_store_bytes_used, sampled every 0.2 s",
            "runs": runs,
        }
        if len(overlaps) == 2:  # the output overlap's effect, per worker count and scenario
            result["overlap"] = [
                {
                    "workers": on["workers"],
                    "prompts_per_reference": on["prompts_per_reference"],
                    "workers_busy_with_overlap": on["workers_busy"],
                    "workers_busy_without_overlap": off["workers_busy"],
                    "images_per_s_with_overlap": on["images_per_s"],
                    "images_per_s_without_overlap": off["images_per_s"],
                }
                for on, off in zip(runs[::2], runs[1::2])
            ]
        if not args.no_startup:
            result["startup"] = time_to_first_image(models_dir, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
