"""Benchmark: one Anima DiT forward and one CFG step.

Cases (one JSON line each on stdout; progress on stderr):
- CPU `real_arch`: the real architecture (width 2048, 16 x 128 heads, MLP 8192, context 512 x 1024,
  28 blocks) with random weights, fp32, at 256x256 px (256 tokens). The fp32 weights take 8.4 GB:
  the script checks free memory and, if 28 blocks do not fit (or `--blocks N` asks for fewer),
  measures N blocks and scales the times to 28 by the FLOP ratio (`blocks_measured` < `blocks`,
  `extrapolated: true`).
- CPU `width_scaled`: width 512 (4 x 128 heads, MLP 2048, context 128 x 256), 28 blocks, 416x608 px
  = 988 tokens, a quarter of 832x1216's 3,952: every FLOP term is the real one / 64, so the
  attention/linear balance is the real one (see common.SCALED).
- `--device cuda`: `real_size` only: real architecture, 832x1216 px (3,952 tokens), bf16, 28 blocks;
  adds the achieved fraction of the GPU's dense bf16 peak (`--peak-tflops`, default 989 for H100/H200).

A forward is one batch row; a CFG step is the engine's step without a reference: ONE batched forward
of the cond and uncond rows, then D = x - sigma * v and the CFG combination.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks.common import (
    REAL,
    SCALED,
    SMOKE,
    DiTGeometry,
    build_dit,
    dit_parameter_bytes,
    emit,
    environment,
    interleaved,
    log,
    parse_dtype,
    resolve_device,
    summarize,
)
from snapref_ray.models.device_memory import available_memory_bytes
from snapref_ray.models.dit import AnimaDiT
from snapref_ray.models.dit_config import real_dit_config
from snapref_ray.models.flops import dit_forward_flop_breakdown, dit_forward_flops
from snapref_ray.sampling.guidance import cfg as cfg_combine

H100_H200_BF16_DENSE_TFLOPS = 989.0
SIGMA = 0.5
CFG = 4.0
MEMORY_MARGIN_BYTES = 2 * 1024**3  # activations, the allocator, the rest of the process
# Every record has these fields (the smoke test checks them; numbers are positive).
FIELDS = (
    "benchmark",
    "case",
    "model_channels",
    "num_heads",
    "head_dim",
    "mlp_hidden",
    "blocks",
    "blocks_measured",
    "extrapolated",
    "context_dim",
    "context_rows",
    "width_px",
    "height_px",
    "tokens",
    "seconds_per_forward",
    "seconds_per_cfg_step",
    "gflop_per_forward",
    "gflop_per_cfg_step",
    "gflops_forward",
    "gflops_cfg_step",
    "attention_flop_share",
    "repeats",
    "environment",
)
CPU_FIELDS = ("cpu_seconds_per_forward", "cpu_seconds_per_cfg_step")  # process CPU time, CPU runs only
CUDA_FIELDS = ("peak_tflops", "percent_of_peak")


def blocks_that_fit(geometry: DiTGeometry, dtype: torch.dtype, requested: int | None) -> int:
    """Blocks to measure on the CPU: `requested`, or as many of the geometry's as free memory holds."""
    block_bytes, other_bytes = dit_parameter_bytes(geometry, dtype)
    available = available_memory_bytes("cpu")
    fit = int((available - MEMORY_MARGIN_BYTES - other_bytes) // block_bytes)
    blocks = min(geometry.num_blocks, fit) if requested is None else requested
    if blocks < 1:
        raise SystemExit(
            f"not enough free memory for even one block at width {geometry.model_channels}"
            f" ({block_bytes / 1e9:.2f} GB per block, {available / 1e9:.1f} GB available)"
        )
    if requested is not None and requested > fit:
        log(
            f"warning: --blocks {requested} needs ~{(other_bytes + requested * block_bytes) / 1e9:.1f} GB,"
            f" {available / 1e9:.1f} GB available"
        )
    return blocks


def cfg_step(dit: AnimaDiT, x_B: torch.Tensor, sigma: float, ctx_2B: torch.Tensor) -> torch.Tensor:
    """One text-CFG step as the engine runs it without a reference: a batched cond+uncond forward, combined."""
    rows_x = x_B.repeat(2, 1, 1, 1, 1)
    v = dit(rows_x, torch.full((rows_x.shape[0],), sigma, device=x_B.device), ctx_2B).float()
    d_cond, d_uncond = (rows_x.float() - sigma * v).chunk(2)
    return cfg_combine(d_cond, d_uncond, CFG)


def run_case(
    case: str,
    geometry: DiTGeometry,
    *,
    device: torch.device,
    dtype: torch.dtype,
    blocks: int,
    repeats: int,
    warmup: int,
    peak_tflops: float | None,
) -> dict[str, Any]:
    """Build the DiT at `geometry` with `blocks` blocks, time a forward and a CFG step (interleaved)."""
    measured = geometry.with_blocks(blocks)
    log(f"[{case}] building width {geometry.model_channels}, {blocks} blocks, {dtype} on {device} ...")
    dit = build_dit(measured, device=device, dtype=dtype)
    if geometry.model_channels == REAL.model_channels and geometry.context_dim == REAL.context_dim:
        assert dit.config == real_dit_config(blocks), "the real-architecture case must build the real config"
    gen = torch.Generator().manual_seed(1)
    h, w = geometry.latent_hw
    x = torch.randn(1, 16, 1, h, w, generator=gen).to(device)
    ctx = torch.randn(2, geometry.context_rows, geometry.context_dim, generator=gen).to(device, dtype)
    sigma_1 = torch.full((1,), SIGMA, device=device)

    cpu_times: dict[str, list[float]] = {}
    with torch.inference_mode():
        times = interleaved(
            {
                "forward": lambda: dit(x.to(dtype), sigma_1, ctx[:1]),
                "cfg_step": lambda: cfg_step(dit, x.to(dtype), SIGMA, ctx),
            },
            device,
            rounds=repeats,
            warmup_rounds=warmup,
            cpu_times=cpu_times,
        )

    shape = dict(tokens=geometry.tokens, context_rows=geometry.context_rows)
    flops_1 = dit_forward_flops(measured.config, rows=1, **shape)
    flops_2 = dit_forward_flops(measured.config, rows=2, **shape)
    full_1 = dit_forward_flops(geometry.config, rows=1, **shape)
    full_2 = dit_forward_flops(geometry.config, rows=2, **shape)
    split = dit_forward_flop_breakdown(geometry.config, rows=2, **shape)
    attention_share = split["attention"] / (split["attention"] + split["linear"])
    t_fwd = summarize(times["forward"])["median_s"]
    t_cfg = summarize(times["cfg_step"])["median_s"]
    record: dict[str, Any] = {
        "benchmark": "dit_forward",
        "case": case,
        **geometry.describe(),
        "blocks_measured": blocks,
        "extrapolated": blocks != geometry.num_blocks,
        # Times are for the geometry's full block count (scaled by the FLOP ratio when fewer were measured).
        "seconds_per_forward": t_fwd * full_1 / flops_1,
        "seconds_per_cfg_step": t_cfg * full_2 / flops_2,
        "measured_seconds_per_forward": t_fwd,
        "measured_seconds_per_cfg_step": t_cfg,
        "seconds_per_forward_min_max": [min(times["forward"]), max(times["forward"])],
        "seconds_per_cfg_step_min_max": [min(times["cfg_step"]), max(times["cfg_step"])],
        "gflop_per_forward": full_1 / 1e9,
        "gflop_per_cfg_step": full_2 / 1e9,
        # Achieved rate of what was measured (independent of the extrapolation).
        "gflops_forward": flops_1 / t_fwd / 1e9,
        "gflops_cfg_step": flops_2 / t_cfg / 1e9,
        "attention_flop_share": attention_share,
        "repeats": repeats,
        "environment": environment(device, dtype),
    }
    if device.type == "cpu":  # process CPU seconds (all threads) of the measured blocks: see common.time_once
        record["cpu_seconds_per_forward"] = summarize(cpu_times["forward"])["median_s"]
        record["cpu_seconds_per_cfg_step"] = summarize(cpu_times["cfg_step"])["median_s"]
    if peak_tflops is not None:
        record["peak_tflops"] = peak_tflops
        record["percent_of_peak"] = 100.0 * flops_2 / t_cfg / (peak_tflops * 1e12)
    return record


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", help="cpu (both CPU cases) or cuda (real size, 832x1216, bf16)")
    p.add_argument(
        "--case",
        choices=("all", "real_arch", "width_scaled"),
        default="all",
        help="CPU cases to run (default all; ignored with --device cuda)",
    )
    p.add_argument(
        "--blocks",
        type=int,
        default=None,
        help="blocks to measure in the real-architecture CPU case (default: 28, or as many as free"
        " memory holds); times are scaled to 28 blocks by the FLOP ratio",
    )
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="compute dtype (default fp32 on CPU, bf16 on CUDA)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported), default 5")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up rounds, default 1")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=H100_H200_BF16_DENSE_TFLOPS,
        help="the GPU's dense bf16 peak in TFLOP/s for %% of peak (default 989: H100/H200 SXM)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 1 repeat: checks the script, measures nothing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the requested cases; print and return one record per case."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.smoke:
        args.repeats, args.warmup = 1, 1
    if device.type == "cuda":
        cases = [("real_size", SMOKE if args.smoke else REAL, None)]
    else:
        # The real architecture at 256x256 px (256 tokens): small enough for a CPU.
        real_arch = SMOKE.with_size(32, 32) if args.smoke else REAL.with_size(256, 256)
        scaled = SMOKE if args.smoke else SCALED
        cases = [
            c
            for c in (("real_arch", real_arch, args.blocks), ("width_scaled", scaled, None))
            if args.case in ("all", c[0])
        ]
    records = []
    for case, geometry, requested_blocks in cases:
        blocks = (
            blocks_that_fit(geometry, dtype, requested_blocks)
            if device.type == "cpu"
            else requested_blocks or geometry.num_blocks
        )
        record = run_case(
            case,
            geometry,
            device=device,
            dtype=dtype,
            blocks=blocks,
            repeats=args.repeats,
            warmup=args.warmup,
            peak_tflops=args.peak_tflops if device.type == "cuda" else None,
        )
        records.append(emit(record))
    return records


if __name__ == "__main__":
    main(sys.argv[1:])
