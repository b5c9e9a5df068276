"""The one-shot GPU suite: everything issues 12 and 24 ask of a GPU, in one command, one JSON + one Markdown.

    python -m benchmarks.gpu_suite --out-dir gpu-suite            # one GPU: real size, bf16, < 8 min
    python -m benchmarks.gpu_suite --smoke --out-dir /tmp/suite   # CPU, tiny: checks the script (CI)
    python -m benchmarks.gpu_suite --device cpu --geometry scaled --blocks 4 --out-dir cpu-suite
    python -m benchmarks.gpu_suite --end-to-end-only --budget-s 560 --out-dir e2e   # only phase 6

The rows run in order of value, each only when its estimate fits what is left of the budget (`--budget-s`,
default 440 s: the suite, its start-up and exit in under 8 minutes on one H100 or H200): first the end-to-end
`run_job` rows (phase 6 below: SnapRef default bf16 compiled from empty caches, then again from the compile
cache it published with an empty local inductor cache, as a new node starts; the same in fp8; ArcAnima v2 at
ref_guidance 1; then the eager rows), then the step microbenchmarks (phases 1-5), then the registered rows.
A row that does not fit is listed under `skipped` with its estimate.

Random weights at real size (Anima 2B: width 2048, 28 blocks, 832x1216 target = 3,952 tokens,
1 MP reference = 4,096 tokens, bf16) through the engine's own step (`benchmarks/snapref_steps.py`'s
`StepBench`: `step_rows`, `Renderer.denoise_rows`, the `Combiner`). Measured:

1. the CFG step without a reference, eager and torch.compile'd: seconds, achieved TFLOP/s and
   % of the dense bf16 peak (`--peak-tflops`, default 989 = H100/H200 SXM);
2. the SnapRef settings side by side (default, ref_in_uncond, ref_guidance, char mode,
   recompute-every-step), eager, interleaved: seconds and ratio to no reference; SnapRef default
   also compiled;
3. the one-off reference encode (the DiT reference stream, fp32 as the design requires);
4. peak device memory (per phase), and the attention read form in use;
5. images per GPU-hour for the recipe (30 steps, 832x1216, CFG 4.5, one reference shared by
   `--prompts-per-reference` images, `--batch` images per forward): DiT steps + the encode share
   only (no text encoding, VAE, PNG or storage: phase 6 has them);
6. end to end (`benchmarks/end_to_end.py`): real `run_job`s on the device, one worker, on a model folder
   of random weights in the real key layouts at real size (`benchmarks/model_folder.py`, written and
   checked in a child process while phases 1-5 run): 2 references x 16 prompts, 832x1216, 30 er_sde
   steps, CFG 4.5, for SnapRef default, ArcAnima v2 at ref_guidance 1 and the pilot, eager and
   compiled, bf16 and fp8 (`--e2e-runs`, in that order of importance). Per run: images per GPU-hour
   against the job's render time and its wall time, and the share of the wall time in start-up, DiT
   sampling, text encoding, reference encode, VAE decode, the memory probe, PNG encoding and storage.

Rows from other features plug in through `benchmarks.suite_rows.register_rows(name, fn)`: fn(context)
returns a dict of figures that lands under `extra_rows` and in the Markdown. Registered by default:
ArcAnima's step ratios (`arcanima_steps.py`) and the step cache's bookkeeping and skipped-step cost
(`step_cache_steps.py`). Estimates: an end-to-end run's from `e2e_runs.RunEstimator`; a step phase's from
the row-step seconds the end-to-end runs measured (`step_phase_estimates`); none before anything was
measured (the phase runs).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks import e2e_runs, end_to_end
from benchmarks.arcanima_steps import arcanima_rows
from benchmarks.common import environment, interleaved, log, paired_ratio, parse_dtype, resolve_device, summarize
from benchmarks.model_folder import MODEL_SETS, ModelFolderWriter, ModelSet
from benchmarks.snapref_steps import ENCODE, GEOMETRIES, SETTINGS, StepBench, StepsGeometry
from benchmarks.step_cache_steps import step_cache_rows
from benchmarks.suite_rows import EXTRA_ROWS, SuiteContext, register_rows
from snapref_ray.models.attention import read_form
from snapref_ray.models.compiled import compile_forward

# The suite's end-to-end rows, in order of value: SnapRef default compiled cold then from the compile
# cache, bf16 then fp8, ArcAnima v2 at ref_guidance 1, then the eager rows of the same.
SUITE_RUNS = (
    "snapref:bf16:compiled,snapref:bf16:compiled-warm,snapref:fp8:compiled,snapref:fp8:compiled-warm,"
    "v2-rg1:bf16:compiled,v2-rg1:bf16:compiled-warm,snapref:bf16:eager,snapref:fp8:eager,v2-rg1:bf16:eager"
)
SUITE_E2E_IMAGES = "2x8"  # 16 images a run: the rows above in one device call
STEP_BENCH_PRIOR_S = 20.0  # building the step bench's models at real size
EXTRA_ROWS_PRIOR_S = 30.0  # one registered section, before anything tells more
RECIPE_STEPS = 30
RECIPE_CFG = 4.5  # the same rows as any CFG != 1: the step's cost does not depend on the scale
PFLOP_PER_IMAGE_NOTE = "about 1.16 PFLOP of DiT work per image at real size (30 CFG steps with a reference)"
FIELDS = (
    "benchmark",
    "geometry",
    "device",
    "dtype",
    "read_form",
    "batch",
    "step",
    "host_syncs",
    "snapref",
    "encode",
    "memory",
    "images_per_gpu_hour",
    "extra_rows",
    "end_to_end",
    "skipped",
    "seconds_total",
    "environment",
)


register_rows("ArcAnima", arcanima_rows)
register_rows("Step cache", step_cache_rows)


def host_syncs(bench: StepBench, device: torch.device) -> dict[str, Any]:
    """Device syncs in one step of each setting, counted by CUDA's sync debug mode ("warn")."""
    if device.type != "cuda":
        return {"checked": False, "why": "no CUDA device (the CPU tests trace the forward with fullgraph instead)"}
    counts: dict[str, Any] = {"checked": True}
    for name in SETTINGS:
        fn = bench.step_fn(name)
        fn()
        torch.cuda.synchronize(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # Only "called a synchronizing CUDA operation" is a sync; the mode's first use also warns that it is
        # a prototype, which is not one.
        syncs = [str(w.message).splitlines()[0] for w in caught if "called a synchronizing" in str(w.message)]
        counts[name] = {"syncs": len(syncs), "first": syncs[0] if syncs else None}
    return counts


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # host RSS high-water mark


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _median(values: list[float]) -> float:
    return summarize(values)["median_s"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The suite: the end-to-end runs that fit the budget, then the step phases that still fit (see the module
    docstring)."""
    t_start = time.perf_counter()
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype)
    geo: StepsGeometry = GEOMETRIES[args.geometry]
    if args.blocks:
        geo = StepsGeometry(
            geo.dit.with_blocks(args.blocks), geo.ref_width_px, geo.ref_height_px, geo.ref_rank, geo.target_rank
        )
    runs = e2e_runs.parse_runs(args.e2e_runs)
    e2e_root = Path(tempfile.mkdtemp(prefix="snapref-e2e-", dir=args.e2e_dir)) if runs else None
    e2e_skipped: list[str] = []
    result: dict[str, Any] = {}
    try:
        if e2e_root is None:
            e2e_skipped.append("end-to-end runs (--e2e-runs none)")
        else:
            writer = ModelFolderWriter(e2e_root / "models", e2e_model_set(args), background=False)
            e2e = end_to_end.run_phase(e2e_config(args, runs, t_start), writer, e2e_root)
            e2e_skipped += [f"end-to-end {s['run']} ({s['why']})" for s in e2e["skipped"]]
            result["end_to_end"] = e2e
            end_to_end.free_device_memory(device)  # the jobs' workers are gone; their cached blocks too
    finally:
        if e2e_root is not None:
            shutil.rmtree(e2e_root, ignore_errors=True)
    if args.end_to_end_only:
        step_skipped = ["step phases (--end-to-end-only)"]
    else:
        steps = step_phases(args, device, dtype, geo, t_start, step_phase_estimates(args, result.get("end_to_end")))
        step_skipped = steps.pop("skipped")
        result.update(steps)
    return {
        "benchmark": "gpu_suite",
        "compile_backend": None if args.no_compile else args.compile_backend,
        "geometry": {**geo.dit.describe(), "name": geo.dit.name, "ref_tokens": geo.ref_tokens},
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "read_form": read_form(),
        "batch": args.batch,
        "rounds": args.rounds,
        "peak_tflops": args.peak_tflops,
        **result,
        "skipped": step_skipped + e2e_skipped,
        "seconds_total": time.perf_counter() - t_start,
        "environment": environment(device, dtype),
    }


def step_phase_estimates(args: argparse.Namespace, e2e: dict[str, Any] | None) -> dict[str, float | None]:
    """Seconds each step phase will take, from the seconds per DiT row and step the end-to-end runs measured
    (the slowest of them: eager when one ran); None for every phase when none finished.

    The eager phase runs every SnapRef setting (up to 3 rows x batch, twice for recompute-every-step) for
    `rounds` + 1 warm-up rounds, then one more for the sync count; the compiled one builds two graphs and
    runs two settings as many rounds.
    """
    done = [r for r in (e2e or {}).get("runs", []) if "error" not in r and r.get("weighted_rows_per_step")]
    if not done:
        return {"eager": None, "compiled": None, "extra_rows": None}
    steps = e2e_runs.recipe_for(e2e_runs.RECIPES[args.geometry], images=args.e2e_images, steps=args.e2e_steps).steps
    unit = max(r["seconds"]["dit_sampling"] / (r["images"] * steps * r["weighted_rows_per_step"]) for r in done)
    row_steps = 3 * args.batch * (len(SETTINGS) + 1)
    eager = STEP_BENCH_PRIOR_S + (args.rounds + 2) * row_steps * unit
    compiled_runs = [r for r in done if r.get("compiled") and r.get("cold_start")]
    built = [r["cold_start"] for r in compiled_runs if r["cold_start"].get("graphs_built")]
    per_graph = (
        max(c["compile_s"] / c["graphs_built"] for c in built) if built else e2e_runs.COMPILE_SECONDS_PER_GRAPH_PRIOR
    )
    compiled = 2 * per_graph + (args.rounds + 1) * 2 * 3 * args.batch * unit
    return {"eager": eager, "compiled": compiled, "extra_rows": EXTRA_ROWS_PRIOR_S * len(EXTRA_ROWS)}


def e2e_model_set(args: argparse.Namespace) -> ModelSet:
    """The model folder of the geometry: real size, width-scaled or tiny; `--blocks` applies to its DiT."""
    ms = MODEL_SETS[args.geometry]
    return replace(ms, dit=ms.dit.with_blocks(args.blocks)) if args.blocks else ms


def e2e_config(args: argparse.Namespace, runs: list[e2e_runs.RunSpec], t_start: float) -> end_to_end.PhaseConfig:
    """The end-to-end phase's settings: the recipe for the geometry, the deadline (the runs go first: their
    estimates rest on the priors and the runs already finished)."""
    base = e2e_runs.RECIPES[args.geometry]
    recipe = e2e_runs.recipe_for(base, images=args.e2e_images, steps=args.e2e_steps)
    return end_to_end.PhaseConfig(
        runs=tuple(runs),
        recipe=recipe,
        device=args.device,
        deadline=t_start + args.budget_s,
        compile_backend=args.compile_backend,
        compile_mode=args.compile_mode,
        no_compile=args.no_compile,
        step_seconds={},
        step_batch=args.batch,
        compile_seconds_per_graph=None,
        startup_prior_s=args.e2e_startup_s,
    )


def _fits(estimate: float | None, deadline: float) -> tuple[bool, str]:
    """(whether a phase of this estimate ends before the deadline, why not)."""
    left = deadline - time.perf_counter()
    if estimate is None or estimate <= left:
        return True, ""
    return False, f"estimated {estimate:.0f} s, {max(0.0, left):.0f} s left of the budget"


def step_phases(
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    geo: StepsGeometry,
    t_start: float,
    estimates: dict[str, float | None] | None = None,
) -> dict[str, Any]:
    """The DiT step phases (1-5 of the module docstring) and the registered rows, each only when its estimate
    (`step_phase_estimates`) fits the budget left."""
    estimates = estimates or {}
    deadline = t_start + args.budget_s
    fits, why = _fits(estimates.get("eager"), deadline)
    if not fits:
        log(f"gpu_suite: skip the step phases: {why}")
        return {"skipped": [f"step phases ({why})"]}
    log(
        f"gpu_suite: {geo.dit.name}, {geo.dit.num_blocks} blocks, {geo.dit.tokens} + {geo.ref_tokens} tokens, "
        f"{dtype} on {device}, batch {args.batch}, read form {read_form()}"
    )
    bench = StepBench(geo, device, dtype, batch=args.batch)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    skipped: list[str] = []
    memory: dict[str, int] = {}

    # -- eager: every SnapRef setting + the encode, interleaved ------------------------------------
    _reset_peak(device)
    cases: dict[str, Callable[[], Any]] = {name: bench.step_fn(name) for name in SETTINGS}
    cases[ENCODE] = bench.encode
    times = interleaved(cases, device, rounds=args.rounds, warmup_rounds=1)
    memory["eager_steps_and_encode"] = _peak_memory_bytes(device)

    def step_record(seconds: float, name: str) -> dict[str, Any]:
        flops = bench.step_flops(name) * args.batch
        rec = {"seconds": seconds, "tflops": flops / seconds / 1e12, "tflop_per_step": flops / 1e12}
        if peak:
            rec["percent_of_peak"] = 100 * flops / seconds / peak
        return rec

    syncs = host_syncs(bench, device)
    step = {"eager": step_record(_median(times["no_reference"]), "no_reference")}
    snapref = {
        name: {
            "seconds": _median(times[name]),
            "ratio_to_no_reference": paired_ratio(times[name], times["no_reference"]),
            "flop_ratio_to_no_reference": bench.step_flops(name) / bench.step_flops("no_reference"),
            "rows": bench.plan(name)[0] * args.batch,
            "reading_rows": bench.plan(name)[1] * args.batch,
        }
        for name in SETTINGS
    }
    encode = {"seconds": _median(times[ENCODE]), "refkv_bytes": bench.refkv.nbytes, "ref_tokens": geo.ref_tokens}

    # -- compiled: the plain step and SnapRef default -----------------------------------------------
    best_default = snapref["snapref_default"]["seconds"]
    if args.no_compile:
        skipped.append("compiled steps (--no-compile)")
    elif not _fits(estimates.get("compiled"), deadline)[0]:
        skipped.append(f"compiled steps ({_fits(estimates.get('compiled'), deadline)[1]})")
    else:
        eager_forward = bench.renderer.forward
        bench.renderer.forward = compile_forward(
            bench.renderer.dit, mode=args.compile_mode, backend=args.compile_backend
        )
        try:
            _reset_peak(device)
            compiled_cases = {name: bench.step_fn(name) for name in ("no_reference", "snapref_default")}
            t0 = time.perf_counter()
            for fn in compiled_cases.values():  # compile (one graph each), outside the timing
                fn()
            compile_s = time.perf_counter() - t0
            ctimes = interleaved(compiled_cases, device, rounds=args.rounds, warmup_rounds=1)
            memory["compiled_steps"] = _peak_memory_bytes(device)
            step["compiled"] = step_record(_median(ctimes["no_reference"]), "no_reference")
            step["compiled"]["compile_seconds"] = compile_s
            step["compiled_speedup"] = paired_ratio(times["no_reference"][: args.rounds], ctimes["no_reference"])
            snapref["snapref_default"]["compiled_seconds"] = _median(ctimes["snapref_default"])
            snapref["snapref_default"]["compiled_ratio_to_no_reference"] = paired_ratio(
                ctimes["snapref_default"], ctimes["no_reference"]
            )
            best_default = min(best_default, _median(ctimes["snapref_default"]))
        finally:
            bench.renderer.forward = eager_forward

    # -- throughput of the recipe ----------------------------------------------------------------------
    seconds_per_image = (
        RECIPE_STEPS * best_default + encode["seconds"] / args.prompts_per_reference * args.batch
    ) / args.batch
    images = {
        "recipe": f"{RECIPE_STEPS} steps, {geo.dit.width_px}x{geo.dit.height_px}, CFG {RECIPE_CFG}, SnapRef "
        f"default, {args.prompts_per_reference} images per reference, batch {args.batch}",
        "seconds_per_image": seconds_per_image,
        "images_per_gpu_hour": 3600 / seconds_per_image,
        "includes": "DiT sampling steps (fastest of eager/compiled) + the reference encode's share",
        "excludes": "text encoding, VAE decode, I/O (the worker overlaps I/O)",
        "note": PFLOP_PER_IMAGE_NOTE,
    }

    extra = {}
    per_section = (estimates.get("extra_rows") or 0.0) / max(1, len(EXTRA_ROWS)) or None
    for name, fn in EXTRA_ROWS.items():
        fits, why = _fits(per_section, deadline)
        if not fits:
            skipped.append(f"{name} rows ({why})")
            continue
        extra[name] = fn(SuiteContext(bench, args, device))
    memory["peak"] = max(memory.values())
    return {
        "step": step,
        "host_syncs": syncs,
        "snapref": snapref,
        "encode": encode,
        "memory": memory,
        "images_per_gpu_hour": images,
        "extra_rows": extra,
        "skipped": skipped,
    }


def markdown(result: dict[str, Any]) -> str:
    """The suite as a Markdown page (what goes into a closing note)."""
    g, env = result["geometry"], result["environment"]
    lines = [
        f"# GPU suite — {env.get('gpu', env['device'])}, {result['dtype']}",
        "",
        f"Geometry {g['name']}: width {g['model_channels']}, {g['blocks']} blocks, {g['width_px']}x{g['height_px']}"
        f" px ({g['tokens']} tokens), reference {g['ref_tokens']} tokens; batch {result['batch']}; read form "
        f"`{result['read_form']}`; torch {env['torch']}; {result['seconds_total']:.0f} s in all.",
        "",
    ]
    if "step" in result:
        lines += step_markdown(result)
    if "end_to_end" in result:
        lines += end_to_end.markdown(result["end_to_end"])
    if result["skipped"]:
        lines += ["Skipped: " + "; ".join(result["skipped"]) + ".", ""]
    return "\n".join(lines)


def step_markdown(result: dict[str, Any]) -> list[str]:
    """The step phases' sections."""
    lines = [
        "## DiT CFG step (no reference)",
        "",
        "| | s / step | TFLOP/s | % of peak |",
        "|---|---|---|---|",
    ]
    for kind in ("eager", "compiled"):
        if kind in result["step"]:
            s = result["step"][kind]
            pct = f"{s['percent_of_peak']:.1f} %" if "percent_of_peak" in s else "—"
            lines.append(f"| {kind} | {s['seconds']:.4f} | {s['tflops']:.3g} | {pct} |")
    if "compiled_speedup" in result["step"]:
        lines += [
            "",
            f"Compiled speed-up: {result['step']['compiled_speedup']:.3f}x "
            f"(compile {result['step']['compiled']['compile_seconds']:.0f} s).",
        ]
    lines += [
        "",
        "## SnapRef settings (eager, interleaved)",
        "",
        "| setting | rows | reading | s / step | x no reference | FLOP model | compiled x |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in result["snapref"].items():
        comp = f"{s['compiled_ratio_to_no_reference']:.3f}" if "compiled_ratio_to_no_reference" in s else ""
        lines.append(
            f"| {name} | {s['rows']} | {s['reading_rows']} | {s['seconds']:.4f} | "
            f"{s['ratio_to_no_reference']:.3f} | {s['flop_ratio_to_no_reference']:.3f} | {comp} |"
        )
    hs = result["host_syncs"]
    if hs.get("checked"):
        lines += [
            "",
            "Device syncs per step (CUDA sync debug mode): "
            + ", ".join(f"{k} {v['syncs']}" for k, v in hs.items() if k != "checked")
            + ".",
        ]
    else:
        lines += ["", f"Device syncs per step: not checked ({hs['why']})."]
    e, m, i = result["encode"], result["memory"], result["images_per_gpu_hour"]
    lines += [
        "",
        f"Reference encode: {e['seconds']:.3f} s ({e['ref_tokens']} tokens, RefKV {e['refkv_bytes'] / 1e9:.3f} GB).",
        "",
        "Peak memory: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in m.items()) + ".",
        "",
        f"**Images per GPU-hour: {i['images_per_gpu_hour']:.0f}** ({i['recipe']}; {i['includes']}; "
        f"excludes {i['excludes']}).",
        "",
    ]
    for name, rows in result["extra_rows"].items():
        lines += [f"## {name}", "", "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in rows.items()] + [""]
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--geometry", choices=list(GEOMETRIES), default=None, help="default: real on CUDA, scaled on CPU")
    p.add_argument("--blocks", type=int, default=None, help="fewer blocks than the geometry's (quick CPU runs)")
    p.add_argument("--dtype", default=None, help="bf16 (CUDA default) | fp16 | fp32 (CPU default)")
    p.add_argument("--batch", type=int, default=None, help="images per forward (default 4 on CUDA, 1 on CPU)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompts-per-reference", type=int, default=8)
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="dense peak for %% of peak (default 989 on CUDA = H100/H200 SXM bf16; none on CPU)",
    )
    p.add_argument("--compile-mode", default=None, help="torch.compile mode (default: inductor's default)")
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend (the smoke run uses 'eager': dynamo's full-graph trace, no codegen)",
    )
    p.add_argument("--no-compile", action="store_true")
    p.add_argument(
        "--budget-s",
        type=float,
        default=440.0,
        help="seconds for the whole suite (default 440: under 8 minutes with start-up and exit): the compiled step "
        "phase runs only if the eager one took less than half, an end-to-end run starts only if its estimate ends "
        "within it",
    )
    p.add_argument(
        "--e2e-runs",
        default=None,
        help="end-to-end runs in order, ADAPTER[-rgG]:bf16|fp8:eager|compiled|compiled-warm, comma-separated"
        f" (ADAPTER: snapref, v2, pilot; 'none' for no end-to-end phase); default {SUITE_RUNS} ({e2e_runs.SMOKE_RUNS}"
        " with --smoke)",
    )
    p.add_argument(
        "--e2e-images",
        default=None,
        help=f"REFERENCESxPROMPTS of the end-to-end job (default {SUITE_E2E_IMAGES}; 1x2 with --smoke)",
    )
    p.add_argument("--e2e-steps", type=int, default=None, help="sampling steps of the end-to-end job (default 30)")
    p.add_argument(
        "--e2e-startup-s",
        type=float,
        default=45.0,
        help="the estimator's start-up seconds of a job before one has run (Ray worker, model load, warm-up)",
    )
    p.add_argument("--e2e-dir", default=None, help="where the model folder and job outputs go (default: the temp dir)")
    p.add_argument(
        "--end-to-end-only", action="store_true", help="skip the step phases: the whole budget for end-to-end runs"
    )
    p.add_argument("--out-dir", default="gpu-suite", help="writes gpu_suite.json and gpu_suite.md here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny geometry, 1 round, the compiled phase traced with the 'eager' backend",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.geometry, args.rounds, args.batch = args.device or "cpu", "smoke", 1, args.batch or 1
        args.compile_backend = "eager"  # an inductor compile costs minutes on a small CPU
        args.e2e_runs = args.e2e_runs if args.e2e_runs is not None else e2e_runs.SMOKE_RUNS
    args.e2e_runs = args.e2e_runs if args.e2e_runs is not None else SUITE_RUNS
    if not args.smoke and args.e2e_images is None and args.geometry in (None, "real"):
        args.e2e_images = SUITE_E2E_IMAGES
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.geometry = args.geometry or ("real" if cuda else "scaled")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.batch = args.batch or (4 if cuda else 1)
    if args.peak_tflops is None and cuda:
        args.peak_tflops = 989.0
    result = run(args)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_suite.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "gpu_suite.md").write_text(markdown(result))
    log(f"wrote {out / 'gpu_suite.json'} and {out / 'gpu_suite.md'}")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
