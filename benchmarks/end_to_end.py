"""The GPU suite's end-to-end phase: real `run_job`s on the suite's device, images per GPU-hour with everything in.

A model folder of random weights in the real key layouts (`benchmarks/model_folder.py`: at real size on
the GPU, the tiny set in `--smoke`) and one job per run: 2 references x 16 prompts at 832x1216, 30 er_sde
steps, CFG 4.5, one worker (`cluster.num_workers: 1`), output threads at their default, a local output
folder; no gallery (a report, not part of producing the dataset). Each run is an adapter x weights x
compile mode (`e2e_runs.RunSpec`, `--e2e-runs`), in order of importance: SnapRef default bf16 compiled
and eager, then fp8, then ArcAnima v2 at ref_guidance 1 and the pilot (its published defaults).

Per run: images per GPU-hour against the job's render seconds (summary.json), its wall seconds
(start-up included) and its DiT sampling alone, and the share of the wall time in each part
(`e2e_timings.SHARES`: start-up, DiT sampling, text encoding, reference encode, VAE decode, the memory
probe, the rest of the render time; PNG encoding and storage in the worker's output threads).

The budget: a run starts only when its estimate (`RunEstimator`) ends before the suite's deadline; runs
that would not are listed under `skipped` with the estimate and the time left, and later, cheaper runs
are still tried.
"""

from __future__ import annotations

import csv
import gc
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import log
from benchmarks.e2e_runs import CFG, SAMPLER, Done, Recipe, RunEstimator, RunSpec
from benchmarks.e2e_timings import (
    OVERLAPPED,
    SHARES,
    TimedRendererFactory,
    png_encode_seconds,
    read_call_log,
    time_breakdown,
)
from benchmarks.model_folder import ADAPTER_FILES, ModelFolderWriter
from snapref_ray.models.tiny_text import TAG_WORDS

REPO = Path(__file__).resolve().parents[1]


def write_job_inputs(folder: Path, recipe: Recipe) -> Path:
    """The recipe's references (synthetic character sheets) and manifest; returns the manifest's path."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(0)
    rows = []
    for r in range(recipe.references):
        side = recipe.reference_side
        img = Image.fromarray(rng.integers(200, 256, (side, side, 3), dtype=np.uint8))  # paper texture
        draw = ImageDraw.Draw(img)
        colour = tuple(int(c) for c in rng.integers(30, 220, 3))
        draw.ellipse((side * 0.35, side * 0.08, side * 0.65, side * 0.38), fill=colour)  # head
        draw.rectangle((side * 0.3, side * 0.38, side * 0.7, side * 0.95), fill=tuple(c // 2 for c in colour))
        path = folder / "references" / f"character-{r}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        img.save(path)
        for p in range(recipe.prompts_per_reference):
            tags = [TAG_WORDS[(7 * r + 5 * p + 3 * k) % len(TAG_WORDS)] for k in range(10)]
            prompt = "1girl, solo, " + ", ".join(tags) + ", masterpiece, best quality"
            rows.append({"reference": path.relative_to(folder).as_posix(), "prompt": prompt, "seed": 1000 * r + p})
    manifest = folder / "manifest.csv"
    with open(manifest, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["reference", "prompt", "seed"])
        writer.writeheader()
        writer.writerows(rows)
    return manifest


# --- one run ------------------------------------------------------------------------------------------


def run_one(
    run: RunSpec,
    *,
    folder: Path,
    manifest: Path,
    recipe: Recipe,
    device: str,
    compile_backend: str,
    compile_mode: str | None,
    start_timeout_s: float,
) -> dict[str, Any]:
    """One `run_job` of `recipe` with `run`'s model; its time breakdown (`e2e_timings.time_breakdown`).

    `start_timeout_s`: how long the worker may take to be ready (the time left in the budget, so that a worker
    that never gets its GPU fails the run instead of outliving the suite).
    """
    # Imported here: the suite imports this module whether or not the phase runs, and these bring in Ray.
    from snapref_ray.job_spec import JobSpec
    from snapref_ray.jobs.generate_dataset import run_job
    from snapref_ray.storage.backends import open_storage
    from snapref_ray.storage.metadata import read_errors_table, read_metadata_table

    out = manifest.parent / "runs" / run.name.replace(":", "-")
    out.mkdir(parents=True)
    # A compiled run shares its compile cache with its compiled-warm twin only; each starts with an empty
    # local inductor cache, so `compiled` builds every graph and `compiled-warm` loads them as a new node would.
    compile_cache = manifest.parent / "compile-cache" / run.cache_name
    call_log = out / "calls.jsonl"
    spec = JobSpec.model_validate(
        {
            "model": {
                "models_dir": str(folder),
                "adapter": str(folder / ADAPTER_FILES[run.kind]),
                "device": device,
                "dtype": "bfloat16",
                "compile": run.compiled,
                "compile_cache": str(compile_cache) if run.compiled else None,
                "quantize": "fp8" if run.weights == "fp8" else "none",
            },
            "manifest": str(manifest),
            "defaults": {
                "width": recipe.width,
                "height": recipe.height,
                "steps": recipe.steps,
                "cfg": CFG,
                "sampler": SAMPLER,
                **run.row_settings(),
            },
            "output": {"uri": str(out / "output")},
            "cluster": {"num_workers": 1, "start_timeout_s": start_timeout_s},
        }
    )
    factory = TimedRendererFactory(
        str(call_log), compile_backend, compile_mode, str(out / "inductor-cache") if run.compiled else None
    )
    workers: list = []
    ready_at: dict[int, float] = {}  # worker pid -> when it was ready (its warm-up done)

    def on_workers(handles: list, infos: list) -> None:
        workers.extend(infos)
        ready_at.update((info.pid, time.time()) for info in infos)

    summary = run_job(spec, progress=False, renderer_factory=factory, write_gallery=False, on_workers=on_workers)
    storage = open_storage(str(out / "output"))
    rows = read_metadata_table(storage).to_pylist()
    record: dict[str, Any] = {
        "run": run.name,
        "adapter_kind": run.kind,
        "weights": run.weights,
        "compiled": run.compiled,
        "weighted_rows_per_step": run.weighted_rows(),
        "failed_items": summary.failed_items,
        "forward_batches": summary.forward_batches,
        "model_load_seconds": max((w.load_seconds for w in workers), default=None),
        # The worker's cold start (render_service/cold_start.py): compile s, graphs built vs loaded, warm-up,
        # first image.
        "cold_start": summary.cold_start[0] if summary.cold_start else None,
    }
    errors = read_errors_table(storage).column("error").to_pylist()
    if errors or summary.images_this_run != recipe.images:
        record["errors"] = errors[:3]
        record["error"] = f"{summary.images_this_run} of {recipe.images} images rendered"
        return record
    png_s = png_encode_seconds(storage.get_bytes(rows[0]["image_key"]))
    record.update(
        time_breakdown(
            summary.to_json(),  # summary.json's content, which time_breakdown reads
            rows,
            read_call_log(call_log),
            job_steps=recipe.steps,
            png_seconds_per_image=png_s,
            ready_at=ready_at,
        )
    )
    record["png_encode_seconds_per_image"] = png_s
    shutil.rmtree(out / "output", ignore_errors=True)  # images: up to 100 MB a run at real size
    return record


# --- the phase ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PhaseConfig:
    """What the phase needs from the suite's arguments and step phases."""

    runs: tuple[RunSpec, ...]
    recipe: Recipe
    device: str
    deadline: float  # time.perf_counter() by which the suite should end
    compile_backend: str = "inductor"
    compile_mode: str | None = None
    no_compile: bool = False
    step_seconds: dict[str, float] | None = None  # SnapRef default s/step from the step phases, by compile mode
    step_batch: int = 4
    compile_seconds_per_graph: float | None = None
    startup_prior_s: float = 45.0


def run_phase(cfg: PhaseConfig, writer: ModelFolderWriter, root: Path) -> dict[str, Any]:
    """Every run that fits the budget, in order; what was skipped and why.

    A phase that cannot start (the model folder failed, Ray did not start) returns its `error` and every run
    as skipped, so the step phases' figures are still written.
    """
    t0 = time.perf_counter()
    try:
        folder_info = writer.wait()
        manifest = write_job_inputs(root / "job", cfg.recipe)
        stop_ray = _start_ray(cfg.device)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        log(f"end to end: not run: {error}")
        return {
            "recipe": cfg.recipe.describe(),
            "error": error,
            "runs": [],
            "skipped": [{"run": r.name, "why": f"the phase did not start: {error.splitlines()[0]}"} for r in cfg.runs],
            "seconds": time.perf_counter() - t0,
        }
    estimator = RunEstimator(
        cfg.recipe,
        step_seconds=cfg.step_seconds or {},
        step_batch=cfg.step_batch,
        compile_seconds_per_graph=cfg.compile_seconds_per_graph,
        startup_prior_s=cfg.startup_prior_s,
    )
    runs: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    try:
        for run in cfg.runs:
            if run.compiled and cfg.no_compile:
                skipped.append({"run": run.name, "why": "--no-compile"})
                continue
            estimate, basis = estimator.estimate(run)
            left = cfg.deadline - time.perf_counter()
            if estimate is not None and estimate > left:  # with nothing measured yet, the run starts
                why = f"estimated {estimate:.0f} s ({basis}), {max(0.0, left):.0f} s left of the budget"
                skipped.append({"run": run.name, "why": why, "estimate_seconds": estimate})
                log(f"end to end: skip {run.name}: {why}")
                continue
            expected = "no estimate" if estimate is None else f"estimated {estimate:.0f} s"
            log(f"end to end: {run.name} ({expected}: {basis}; {left:.0f} s left) ...")
            t_run = time.perf_counter()
            try:
                record = run_one(
                    run,
                    folder=writer.folder,
                    manifest=manifest,
                    recipe=cfg.recipe,
                    device=cfg.device,
                    compile_backend=cfg.compile_backend,
                    compile_mode=cfg.compile_mode,
                    start_timeout_s=max(60.0, left),
                )
            except Exception as e:  # one failing run must not cost the others
                record = {"run": run.name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            record["estimate_seconds"], record["estimate_basis"] = estimate, basis
            record["seconds_including_driver"] = time.perf_counter() - t_run
            runs.append(record)
            if "error" not in record:
                sampling = record["seconds"]["dit_sampling"]
                estimator.done.append(Done(run, record["wall_seconds"], sampling, record["images"], cfg.recipe.steps))
            log(f"end to end: {run.name} done: {_one_line(record)}")
    finally:
        if stop_ray is not None:
            stop_ray()
        gc.collect()
    return {
        "recipe": cfg.recipe.describe(),
        "model_folder": folder_info,
        "runs": runs,
        "skipped": skipped,
        "shares": list(SHARES),
        "overlapped": list(OVERLAPPED),
        "seconds": time.perf_counter() - t0,
    }


def _start_ray(device: str) -> Callable[[], None] | None:
    """A local Ray for the jobs unless one is running: the call that stops it, or None if one was running."""
    import ray

    from benchmarks.local_ray import start_local_ray

    if ray.is_initialized():
        return None
    # The workers import the renderer factory (benchmarks/) and the project from this checkout.
    cuda = device.startswith("cuda")
    return start_local_ray(
        num_cpus=None if cuda else 4,  # on a small CPU: more slots than cores, as the tests do
        num_gpus=torch.cuda.device_count() if cuda else 0,  # declared: the worker must not wait on GPU detection
    )


def _one_line(record: dict[str, Any]) -> str:
    if "error" in record:
        return record["error"]
    i = record["images_per_gpu_hour"]
    return f"{record['images']} images, {i['render']:.0f}/h rendering, {i['wall']:.0f}/h with start-up"


# --- Markdown -----------------------------------------------------------------------------------------


def markdown(e2e: dict[str, Any]) -> list[str]:
    """The end-to-end section of the suite's page."""
    if "error" in e2e:
        return ["## End to end (`run_job`, one worker)", "", f"Not run: {e2e['error']}", ""]
    mf = e2e["model_folder"]
    lines = [
        "## End to end (`run_job`, one worker)",
        "",
        f"Recipe: {e2e['recipe']}. Model folder `{mf['set']}`: {_size(mf['bytes'])} written in {mf['seconds']:.0f} s"
        f" and checked in {mf['check']['seconds']:.0f} s"
        + (f" beside the step phases (then waited {mf['waited_seconds']:.0f} s for it)." if mf["background"] else "."),
        "",
        "Images per GPU-hour against the job's render time, its wall time (start-up included) and its DiT"
        " sampling alone; then the share of the wall time in each part:",
        "",
        "| run | images | /h render | /h wall | /h DiT only | wall s | "
        + " | ".join(_LABELS[c] for c in SHARES)
        + " |",
        "|---|" + "---|" * (5 + len(SHARES)),
    ]
    for r in e2e["runs"]:
        if "error" in r:
            lines.append(f"| {r['run']} | failed: {r['error'].splitlines()[0][:160]} |")
            continue
        i, share = r["images_per_gpu_hour"], r["share_of_wall"]
        lines.append(
            f"| {r['run']} | {r['images']} | {i['render']:.0f} | {i['wall']:.0f} | {i['dit_sampling_only']:.0f} | "
            f"{r['wall_seconds']:.0f} | " + " | ".join(f"{100 * share[c]:.1f} %" for c in SHARES) + " |"
        )
    lines += [
        "",
        "Start-up: Ray worker, model load, warm-up. Reference encode: the VAE encode and the DiT's reference stream."
        " Other render: the render time off the device's path (scheduling, Ray calls, the device idle). PNG and"
        " storage run in the worker's output threads beside the next batch's sampling (PNG timed apart on one"
        " output image, storage the rest of `upload_s`).",
        "",
    ]
    return lines  # skipped runs are in the suite's "Skipped" line


_LABELS = {
    "startup": "start-up",
    "dit_sampling": "DiT sampling",
    "text_encoding": "text",
    "reference_encode": "reference encode",
    "vae_decode": "VAE decode",
    "memory_probe": "memory probe",
    "other_render": "other render",
    "png_encode": "PNG",
    "storage": "storage",
}


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def free_device_memory(device: torch.device) -> None:
    """Give the step phases' cached device memory back before the worker needs the device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
