"""Benchmark: peak memory of a batch's VAE decode against one image's, and what tiling costs.

Cases (one JSON line each on stdout; progress on stderr). Memory is the peak RSS (`ru_maxrss`) of a
fresh subprocess per measurement, CPU fp32, so nothing one run allocates or caches leaks into the next:
- `render`: a full `Renderer.render` on the tiny model set (`snapref_ray.tiny.make_tiny`) at
  1024x1024, a batch of 4 against a batch of 1 (2 steps: this measures memory, not speed).
- `real_vae_decode`: the real-size Qwen-Image VAE (random weights in the real key layout) decoding
  four 832x1216 latents against one, through `Renderer.decode` (the tiny renderer, its VAE
  replaced), the path every render takes.
- `tiling`: tiled against untiled decode of one latent on the tiny VAE, in 0..255 units, for this
  project's tiling (attention on the whole latent, convolution stages in tiles) and for tiling
  the whole network (each tile's attention sees only the tile, as ComfyUI's tiled decode does),
  at several overlaps. `--tiling-vae real` runs it on the real-size VAE (minutes on a CPU).

Both memory cases report per batch `peak_rss_bytes` (`ru_maxrss`: the process's peak over its life,
models included), `rss_before_bytes` (RSS when the measured call starts) and
`call_peak_above_start_bytes` (the kernel's high-water mark, restarted at that moment, minus it: the
call's own peak), plus `vae_plans` (the plan lines the VAE logged), `ratio` = peak_rss(batch 4) /
peak_rss(batch 1) and whether it meets the target (<= 1.35, docs/design.md#performance-targets).

The script runs against any checkout of the project (`PYTHONPATH=<checkout>`), so the same command
measures a tree before and after a change; the estimate and plan fields are filled where the tree
has `snapref_ray.models.vae_memory`.

    python -m benchmarks.vae_memory                       # all three cases
    python -m benchmarks.vae_memory --case real_vae_decode
    python -m benchmarks.vae_memory --smoke               # tiny sizes (tests/benchmarks)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import emit, environment, log
from snapref_ray.geometry import latent_size
from snapref_ray.render_service.memory import peak_resident_bytes, reset_peak_resident, resident_bytes

TARGET_RATIO = 1.35
CASES = ("render", "real_vae_decode", "tiling")
# Every record has these fields (tests/benchmarks/test_vae_memory_smoke.py checks them).
MEMORY_FIELDS = (
    "benchmark",
    "case",
    "width_px",
    "height_px",
    "batches",
    "peak_rss_bytes",
    "rss_before_bytes",
    "call_peak_above_start_bytes",
    "seconds",
    "ratio",
    "target_ratio",
    "met",
    "environment",
)
TILING_FIELDS = ("benchmark", "case", "vae", "latent_hw", "tile", "rows", "environment")


# --- measured in a fresh subprocess ---------------------------------------------------------


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one measurement in this (fresh) process; peak RSS over the whole process life."""
    from snapref_ray.engine import Renderer
    from snapref_ray.requests import RenderRequest, RenderSettings

    plans = _PlanLog()
    logging.getLogger("snapref_ray.models.vae_memory").addHandler(plans)
    logging.getLogger("snapref_ray.models.vae_memory").setLevel(logging.DEBUG)
    torch.manual_seed(0)
    renderer = Renderer.from_folder(spec["models"], device="cpu")
    width, height, batch = spec["width"], spec["height"], spec["batch"]
    if spec["case"] == "render":
        settings = RenderSettings(width=width, height=height, steps=spec["steps"])
        requests = [RenderRequest(prompt="1girl, solo", seed=i, settings=settings) for i in range(batch)]
        reset = reset_peak_resident()
        rss_before = resident_bytes()
        t0 = time.perf_counter()
        images = [r.image for r in renderer.render(requests)]
    else:
        from snapref_ray.models.tiny_vae import random_vae_state_dict
        from snapref_ray.models.vae import load_vae
        from snapref_ray.models.vae_config import VAEConfig

        renderer.vae = load_vae(random_vae_state_dict(VAEConfig(base_dim=spec["vae_base_dim"])))
        latent = torch.randn(
            batch, 16, 1, *latent_size(height=height, width=width), generator=torch.Generator().manual_seed(0)
        )
        reset = reset_peak_resident()
        rss_before = resident_bytes()
        t0 = time.perf_counter()
        images = renderer.decode(latent)
    seconds = time.perf_counter() - t0
    if [im.size for im in images] != [(width, height)] * batch:
        raise RuntimeError(f"expected {batch} images of {width}x{height}, got {[im.size for im in images]}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    # The measured call's own peak above the RSS it started from. `peak - rss_before` would not do:
    # pages the kernel reclaims from the process meanwhile (library code under memory pressure) lower
    # rss_before but not the life-long peak.
    call_peak = peak_resident_bytes() - rss_before if reset else None
    return {
        "peak_rss_bytes": peak,
        "rss_before_bytes": rss_before,
        "call_peak_above_start_bytes": call_peak,
        "seconds": seconds,
        "vae_plans": plans.lines,
    }


class _PlanLog(logging.Handler):
    """Keeps the VAE's plan lines (debug level), so a record says what ran; none on older trees."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """`_child(spec)` in a fresh interpreter, its JSON result.

    The child's PYTHONPATH is the caller's (a checkout named there is the one measured) followed by this tree, which
    holds `benchmarks`: with a PYTHONPATH that named something else only, the child could not import this script's
    own package and every measurement failed.
    """
    own_tree = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), own_tree) if p)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"measurement {spec} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _one_image_estimate(width: int, height: int, vae_base_dim: int) -> int | None:
    try:  # a tree from before the VAE's memory estimates has none; the measurement itself needs none
        from snapref_ray.models.vae_config import VAEConfig
        from snapref_ray.models.vae_estimates import decode_peak_bytes
    except ImportError:
        return None
    return decode_peak_bytes(VAEConfig(base_dim=vae_base_dim), (height // 8, width // 8), torch.float32)


def memory_case(case: str, models: Path, width: int, height: int, steps: int, vae_base_dim: int) -> dict[str, Any]:
    """Peak RSS of batch 1 and batch 4 (each in a fresh process) and their ratio."""
    batches = (1, 4)
    results = {}
    for batch in batches:
        log(f"{case}: batch {batch} at {width}x{height} ...")
        spec = {"case": case, "models": str(models), "width": width, "height": height, "batch": batch}
        spec |= {"steps": steps, "vae_base_dim": vae_base_dim}
        results[batch] = measure(spec)
        log(f"  peak RSS {results[batch]['peak_rss_bytes'] / 2**30:.2f} GiB in {results[batch]['seconds']:.1f} s")
    ratio = results[4]["peak_rss_bytes"] / results[1]["peak_rss_bytes"]
    record: dict[str, Any] = {
        "benchmark": "vae_memory",
        "case": case,
        "width_px": width,
        "height_px": height,
        "batches": list(batches),
        "peak_rss_bytes": [results[b]["peak_rss_bytes"] for b in batches],
        "rss_before_bytes": [results[b]["rss_before_bytes"] for b in batches],
        "call_peak_above_start_bytes": [results[b]["call_peak_above_start_bytes"] for b in batches],
        "seconds": [results[b]["seconds"] for b in batches],
        "ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "met": ratio <= TARGET_RATIO,
        "vae_plans": {str(b): results[b]["vae_plans"] for b in batches},
        "estimated_one_image_decode_peak_bytes": _one_image_estimate(width, height, vae_base_dim),
        "environment": environment(torch.device("cpu"), torch.float32),
    }
    if case == "render":
        record["steps"] = steps
    else:
        record["vae_base_dim"] = vae_base_dim
    return record


# --- tiling error (in process) ----------------------------------------------------------------


def _whole_network_tiled(vae, latent: torch.Tensor, tile: int, overlap: int) -> torch.Tensor:
    """Each tile through the whole decoder, attention included (ComfyUI's way), blended like ours."""
    from snapref_ray.models.vae_tiles import decode_reach, tile_spans, tile_weights

    z = vae.prepare_latent(latent)
    _, _, h, w = z.shape
    f, reach = vae.config.spatial_factor, decode_reach(vae.config)
    rows, cols = tile_spans(h, tile, overlap), tile_spans(w, tile, overlap)
    row_w, col_w = tile_weights(rows, h, overlap, reach, f), tile_weights(cols, w, overlap, reach, f)
    out = torch.zeros(z.shape[0], 3, h * f, w * f)
    for (top, bottom), wy in zip(rows, row_w):
        for (left, right), wx in zip(cols, col_w):
            part = vae.decode(z[:, :, top:bottom, left:right].contiguous()).float()
            out[:, :, top * f : bottom * f, left * f : right * f] += part * (wy[:, None] * wx[None, :])
    return out.clamp_(-1, 1)


def tiling_case(vae_kind: str, latent_hw: tuple[int, int], tile: int, overlaps: list[int]) -> dict[str, Any]:
    """Max / mean |tiled - untiled| in 0..255 units and the share of uint8 values that differ, per overlap."""
    from snapref_ray.models.latent_format import process_out
    from snapref_ray.models.tiny_vae import random_vae_state_dict
    from snapref_ray.models.vae import load_vae
    from snapref_ray.models.vae_config import VAEConfig
    from snapref_ray.models.vae_tiles import decode_reach, decode_tiled, exact_overlap

    config = VAEConfig() if vae_kind == "real" else VAEConfig(base_dim=8)
    vae = load_vae(random_vae_state_dict(config, seed=0))
    latent = process_out(torch.randn(1, 16, *latent_hw, generator=torch.Generator().manual_seed(0)))

    def to255(x: torch.Tensor) -> torch.Tensor:
        return (x.double() + 1) / 2 * 255

    rows = []
    with torch.inference_mode():
        untiled = to255(vae.decode(latent))
        for overlap in overlaps:
            log(f"tiling ({vae_kind}): overlap {overlap} ...")
            row: dict[str, Any] = {"overlap": overlap}
            for name, run in (("ours", decode_tiled), ("whole_network", _whole_network_tiled)):
                out = to255(run(vae, latent, tile, overlap))
                diff = (out - untiled).abs()
                row[name] = {
                    "max_abs_255": diff.max().item(),
                    "mean_abs_255": diff.mean().item(),
                    "uint8_differ_fraction": (out.round() != untiled.round()).double().mean().item(),
                }
            rows.append(row)
    return {
        "benchmark": "vae_memory",
        "case": "tiling",
        "vae": vae_kind,
        "latent_hw": list(latent_hw),
        "tile": tile,
        "decode_reach_cells": decode_reach(config),
        "default_overlap": exact_overlap(decode_reach(config)),
        "untiled_inside_fraction": (untiled.sub(127.5).abs() < 127.5).double().mean().item(),
        "rows": rows,
        "environment": environment(torch.device("cpu"), torch.float32),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=CASES, action="append", help="run only these cases (repeatable)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script, measures nothing real")
    parser.add_argument("--tiling-vae", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(json.loads(args.child))), flush=True)
        return []
    cases = args.case or list(CASES)
    records = []
    with tempfile.TemporaryDirectory(prefix="vae-memory-") as tmp:
        models = None
        if {"render", "real_vae_decode"} & set(cases):
            from snapref_ray.tiny import make_tiny

            models = make_tiny(Path(tmp) / "tiny", with_adapter=False)
        if "render" in cases:
            size = 256 if args.smoke else 1024
            records.append(emit(memory_case("render", models, size, size, 1 if args.smoke else 2, 8)))
        if "real_vae_decode" in cases:
            width, height, base_dim = (64, 96, 8) if args.smoke else (832, 1216, 96)
            records.append(emit(memory_case("real_vae_decode", models, width, height, 0, base_dim)))
        if "tiling" in cases:
            if args.smoke:
                records.append(emit(tiling_case("tiny", (12, 10), 8, [2, 6])))
            elif args.tiling_vae == "real":
                records.append(emit(tiling_case("real", (40, 40), 32, [8, 16, 28])))
            else:
                records.append(emit(tiling_case("tiny", (48, 40), 32, [4, 8, 16, 28])))
    return records


if __name__ == "__main__":
    main()
