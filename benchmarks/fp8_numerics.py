"""Benchmark: quantize="fp8" (models/fp8.py) against bf16 — its error, and on CUDA its step time.

Cases (one JSON line each on stdout; progress on stderr):
- `linear` (any device): the three block-linear shapes of a real-size block at 3,952 tokens
  (832x1216 px): q_proj 2048 -> 2048, mlp.layer1 2048 -> 8192, mlp.layer2 8192 -> 2048, random
  normal activations and weights; the relative (Frobenius) error against the float64 linear of the
  fp8 path and of plain bf16, side by side.
- `tiny_render` (any device): a whole render on the tiny model set with its SnapRef adapter and
  reference, bf16 and fp8 from the same seed: the final latent's relative error and the decoded
  image's PSNR, fp8 against bf16. The tiny model is random: a plumbing figure, not a quality claim.
- `step_time` (`--device cuda`): one CFG step (one batched forward of cond + uncond, 2 rows) of the
  real-size DiT (random weights, bf16, 28 blocks) at 832x1216 px, bf16 and fp8 timed interleaved
  (each round runs both, the order alternating), medians and the median of per-round ratios; with
  `--compile`, both forwards through models/compiled.py (inductor) as well.

`--smoke` runs every case at tiny sizes on the CPU, including `step_time` (checks the script, measures
nothing).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import (
    REAL,
    SMOKE,
    build_dit,
    emit,
    environment,
    interleaved,
    log,
    paired_ratio,
    resolve_device,
    summarize,
)
from snapref_ray.models.compiled import compile_forward
from snapref_ray.models.fp8 import fp8_linear, quantize_dit, quantize_rows

SIGMA = 0.5
# (name, in, out) of the block linears the `linear` case measures, at the real width.
LINEAR_SHAPES = (("self_attn.q_proj", 2048, 2048), ("mlp.layer1", 2048, 8192), ("mlp.layer2", 8192, 2048))
SMOKE_LINEAR_SHAPES = (("self_attn.q_proj", 64, 64), ("mlp.layer1", 64, 256), ("mlp.layer2", 256, 64))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius), in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two uint8 images (inf when equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def linear_case(device: torch.device, tokens: int, shapes) -> dict[str, Any]:
    """fp8 and bf16 relative errors against float64, per block-linear shape."""
    gen = torch.Generator().manual_seed(0)
    errors = {}
    for name, fan_in, fan_out in shapes:
        x = torch.randn(tokens, fan_in, generator=gen)
        w = torch.randn(fan_out, fan_in, generator=gen) / math.sqrt(fan_in)
        exact = x.double() @ w.double().T
        x_bf16, w_bf16 = x.to(device, torch.bfloat16), w.to(device, torch.bfloat16)
        w_q, w_scale = quantize_rows(w_bf16)
        with torch.inference_mode():
            fp8 = fp8_linear(x_bf16, w_q, w_scale.reshape(-1)).cpu()
            bf16 = (x_bf16 @ w_bf16.T).cpu()
        errors[name] = {"fp8": relative_error(fp8, exact), "bf16": relative_error(bf16, exact)}
        log(f"[linear] {name} ({fan_in} -> {fan_out}): fp8 {errors[name]['fp8']:.4f}, bf16 {errors[name]['bf16']:.4f}")
    return {
        "benchmark": "fp8_numerics",
        "case": "linear",
        "tokens": tokens,
        "relative_error_vs_float64": errors,
        "environment": environment(device, torch.bfloat16),
    }


def tiny_render_case(device: torch.device, steps: int) -> dict[str, Any]:
    """A tiny-model render with a reference, bf16 and fp8: final latent relative error and image PSNR."""
    from snapref_ray.engine import Renderer
    from snapref_ray.requests import RenderRequest, RenderSettings
    from snapref_ray.tiny import make_tiny

    settings = RenderSettings(width=256, height=256, steps=steps, sampler="euler")
    request = RenderRequest(prompt="1girl, solo, smile", seed=7, settings=settings)
    latents, images = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        models = make_tiny(Path(folder))
        reference = (models / "reference.png").read_bytes()
        for mode in (None, "fp8"):
            renderer = Renderer.from_folder(models, device=device, dtype=torch.bfloat16, quantize=mode)
            decode = renderer.decode

            def keep_latent(latent, mode=mode, decode=decode):
                latents[mode] = latent.float().cpu()
                return decode(latent)

            renderer.decode = keep_latent  # the render is unchanged; its final latent is kept on the way out
            images[mode] = np.asarray(renderer.render([request], references=[reference])[0].image)
    record = {
        "benchmark": "fp8_numerics",
        "case": "tiny_render",
        "width_px": settings.width,
        "height_px": settings.height,
        "steps": steps,
        "latent_relative_error": relative_error(latents["fp8"], latents[None]),
        "image_psnr_db": psnr(images["fp8"], images[None]),
        "environment": environment(device, torch.bfloat16),
    }
    rel, db = record["latent_relative_error"], record["image_psnr_db"]
    log(f"[tiny_render] latent relative error {rel:.4f}, PSNR {db:.1f} dB")
    return record


def step_time_case(device: torch.device, geometry, *, rounds: int, warmup: int, compile: bool) -> dict[str, Any]:
    """bf16 vs fp8 seconds per CFG step (2 rows, one forward), interleaved; and the fp8 step's error."""
    log(f"[step_time] building two {geometry.num_blocks}-block DiTs at width {geometry.model_channels} on {device} ...")
    bf16 = build_dit(geometry, device=device, dtype=torch.bfloat16)
    fp8 = copy.deepcopy(bf16)  # the same weights, without building them twice
    quantize_dit(fp8, "fp8")
    gen = torch.Generator().manual_seed(1)
    h, w = geometry.latent_hw
    x = torch.randn(2, 16, 1, h, w, generator=gen).to(device, torch.bfloat16)
    ctx = torch.randn(2, geometry.context_rows, geometry.context_dim, generator=gen).to(device, torch.bfloat16)
    sigma = torch.full((2,), SIGMA, device=device)
    forwards = {"bf16": bf16, "fp8": fp8}
    if compile:
        forwards |= {"bf16_compiled": compile_forward(bf16), "fp8_compiled": compile_forward(fp8)}
    with torch.inference_mode():
        times = interleaved(
            {name: (lambda f=f: f(x, sigma, ctx)) for name, f in forwards.items()},
            device,
            rounds=rounds,
            warmup_rounds=warmup,
        )
        step_error = relative_error(fp8(x, sigma, ctx).cpu(), bf16(x, sigma, ctx).cpu())
    seconds = {name: summarize(t)["median_s"] for name, t in times.items()}
    record: dict[str, Any] = {
        "benchmark": "fp8_numerics",
        "case": "step_time",
        **geometry.describe(),
        "rows": 2,
        "seconds_per_step": seconds,
        "seconds_per_step_min_max": {name: [min(t), max(t)] for name, t in times.items()},
        "fp8_over_bf16": paired_ratio(times["fp8"], times["bf16"]),
        "fp8_velocity_relative_error_vs_bf16": step_error,
        "rounds": rounds,
        "environment": environment(device, torch.bfloat16),
    }
    if compile:
        record["fp8_over_bf16_compiled"] = paired_ratio(times["fp8_compiled"], times["bf16_compiled"])
    if device.type == "cuda":
        record["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    log(f"[step_time] {seconds}, fp8/bf16 {record['fp8_over_bf16']:.3f}")
    return record


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", help="cpu (errors only) or cuda (errors and step times)")
    p.add_argument("--steps", type=int, default=8, help="sampling steps of the tiny render (default 8)")
    p.add_argument("--rounds", type=int, default=10, help="timed interleaved rounds of step_time (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up rounds of step_time (default 2)")
    p.add_argument("--compile", action="store_true", help="step_time: also time both forwards compiled (inductor)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, every case: checks the script")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the cases for the device; print and return one record per case."""
    args = parse_args(argv)
    device = torch.device("cpu") if args.smoke else resolve_device(args.device)
    records = [
        emit(
            linear_case(device, 40 if args.smoke else REAL.tokens, SMOKE_LINEAR_SHAPES if args.smoke else LINEAR_SHAPES)
        ),
        emit(tiny_render_case(device, 2 if args.smoke else args.steps)),
    ]
    if args.smoke or device.type == "cuda":
        geometry = SMOKE if args.smoke else REAL
        rounds, warmup = (1, 1) if args.smoke else (args.rounds, args.warmup)
        records.append(emit(step_time_case(device, geometry, rounds=rounds, warmup=warmup, compile=args.compile)))
    return records


if __name__ == "__main__":
    main(sys.argv[1:])
