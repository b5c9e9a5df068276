"""Benchmark: seconds per sampling step with and without a SnapRef reference.

Prints ONE JSON table (laid out like the timing table's comparison_summary.json): for each setting the
median seconds per step and its ratio to the no-reference step, the one-off reference encode
time, the RefKV size, and the three step targets (docs/design.md#performance-targets) with
met/missed. All settings are measured side by side in one run: every round times each setting
once, in a rotated order (common.interleaved), so load and clock drift land on all of them alike;
ratios are medians of per-round ratios.

Settings (text CFG 4, so every step has a cond and an uncond row):
- no_reference: the plain Anima step (2 rows, no adapter LoRA, no read);
- snapref_default: cond row reads the cached reference, target LoRA on (2 rows);
- ref_in_uncond: both rows read (2 rows);
- ref_guidance: ref_guidance = 1.5, both rows read + a cond row without the reference (3 rows);
- recompute_every_step: the reference stream is run again before each default step (pilot-style);
- char_mode: the default step with mode `char` (per-block read weights < 1: the weighted read path);
- reference_encode (not a step): the one-off reference stream that makes the RefKV.

What runs is the engine's own code: a `Renderer` whose DiT, adapter, device and dtype are set
directly (no text encoder or VAE is loaded: the step does not use them), and a step function that
does what `Renderer._render_batch`'s `denoise` closure does: `step_rows`, `_run_reference_stream`
when recomputing, `Renderer.denoise_rows` (one batched forward, reads from `RefKV.reads`, the
bound adapter's target LoRAs) and the `Combiner`. The reference is a random normalised latent:
VAE encoding and the caption's text encoding are not part of `encode_seconds`.

Geometries: on the CPU, `scaled` (width 512 = 4 x 128 heads, 28 blocks, MLP 2048, context 128 x 256,
416x608 px = 988 target tokens, a 512x512 px reference = 1,024 tokens, ref rank 32, target rank 16):
every length is the real one / 4, so every FLOP term (and every ratio of the FLOP model) is the
real one. With --device cuda, `real`: width 2048, 832x1216 px (3,952 tokens), 1024x1024 px
reference (4,096 tokens, 1 MP), ranks 128 / 64, bf16.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import (
    REAL,
    SCALED,
    SMOKE,
    DiTGeometry,
    build_dit,
    emit,
    environment,
    interleaved,
    log,
    paired_ratio,
    parse_dtype,
    resolve_device,
    summarize,
    time_once,
    tokens_for,
)
from snapref_ray.adapter.generate import make_adapter
from snapref_ray.adapter.reference_adapter import PreparedReference
from snapref_ray.adapter.refkv import RefKV
from snapref_ray.adapter.snapref import BoundSnapRef
from snapref_ray.engine import Renderer
from snapref_ray.geometry import latent_size
from snapref_ray.models.compiled import compile_forward
from snapref_ray.models.flops import block_linear_dims, dit_forward_flops
from snapref_ray.requests import RenderSettings
from snapref_ray.sampling.ref_guidance import Combiner, Row, step_rows

SIGMA = 0.5  # a mid-schedule step; the cost of a step does not depend on sigma
CFG = 4.0
REF_GUIDANCE = 1.5


@dataclass(frozen=True)
class StepsGeometry:
    dit: DiTGeometry
    ref_width_px: int
    ref_height_px: int
    ref_rank: int
    target_rank: int

    @property
    def ref_tokens(self) -> int:
        return tokens_for(self.ref_width_px, self.ref_height_px)


GEOMETRIES = {
    "scaled": StepsGeometry(SCALED, 512, 512, ref_rank=32, target_rank=16),
    "real": StepsGeometry(REAL, 1024, 1024, ref_rank=128, target_rank=64),
    # RenderSettings needs sides >= 256 px; at width 64 and 2 blocks that is still milliseconds.
    "smoke": StepsGeometry(SMOKE.with_size(256, 256), 64, 64, ref_rank=4, target_rank=2),
}

# name -> (settings overrides, has a reference)
SETTINGS: dict[str, tuple[dict[str, Any], bool]] = {
    "no_reference": ({}, False),
    "snapref_default": ({}, True),
    "ref_in_uncond": ({"ref_in_uncond": True}, True),
    "ref_guidance": ({"ref_guidance": REF_GUIDANCE}, True),
    "recompute_every_step": ({"recompute_reference_every_step": True}, True),
    "char_mode": ({"mode": "char"}, True),
}
ENCODE = "reference_encode"
# Every table has these fields, and every setting these (the smoke test checks them; numbers are positive).
FIELDS = (
    "benchmark",
    "geometry",
    "device",
    "dtype",
    "rounds",
    "settings",
    "encode_seconds",
    "refkv_bytes",
    "targets",
    "environment",
)
SETTING_FIELDS = (
    "rows",
    "reading_rows",
    "seconds_per_step",
    "seconds_min",
    "seconds_max",
    "ratio_to_no_reference",
    "flop_ratio_to_no_reference",
    "gflop_per_step",
    "gflops",
)
TARGET_FIELDS = ("measured", "limit", "flop_model", "met", "measured_from_minimums")
# Process CPU time figures, on CPU runs only (see common.time_once).
CPU_SETTING_FIELDS = ("cpu_seconds_per_step", "cpu_ratio_to_no_reference")
CPU_TARGET_FIELDS = ("measured_cpu_time",)


class StepBench:
    """The engine's step for every setting, on a Renderer holding only a DiT and a bound adapter."""

    def __init__(
        self, geo: StepsGeometry, device: torch.device, dtype: torch.dtype, *, compile: bool = False, batch: int = 1
    ) -> None:
        """`batch`: images (requests) per step, each with its cond/uncond rows; `compile`: forward compiled."""
        self.geo, self.device, self.dtype, self.batch = geo, device, dtype, batch
        g = geo.dit
        renderer = Renderer.__new__(Renderer)  # no text encoder / VAE: the step does not use them
        renderer.device, renderer.dtype = device, dtype
        renderer.dit = build_dit(g, device=device, dtype=dtype)
        renderer.forward = compile_forward(renderer.dit) if compile else renderer.dit
        adapter = make_adapter(
            num_blocks=g.num_blocks,
            model_channels=g.model_channels,
            context_dim=g.context_dim,
            mlp_hidden=4 * g.model_channels,
            ref_rank=geo.ref_rank,
            target_rank=geo.target_rank,
            init="random",
            seed=0,
        )
        renderer.adapter = BoundSnapRef.bind(adapter, g.num_blocks, device, dtype)
        self.renderer = renderer
        self.grid = renderer.target_grid(g.width_px, g.height_px)

        gen = torch.Generator().manual_seed(1)
        h, w = g.latent_hw
        self.x = torch.randn(batch, 16, 1, h, w, generator=gen).to(device)  # the sampler's latent stays fp32
        self.sigma = torch.tensor(SIGMA)  # a host scalar, as the samplers pass it (no read-back per step)
        ctx = torch.randn(2, g.context_rows, g.context_dim, generator=gen).to(device, dtype)
        # Per row kind, one [1, S, C] context per request (one request here), as _render_batch builds it.
        self.ctx_for = {Row.COND: [ctx[:1]] * batch, Row.UNCOND: [ctx[1:]] * batch, Row.COND_NOREF: [ctx[:1]] * batch}
        ref_latent = torch.randn(
            1, 16, *latent_size(height=geo.ref_height_px, width=geo.ref_width_px), generator=gen
        ).to(device)
        ref_context = torch.randn(1, g.context_rows, g.context_dim, generator=gen).to(device)
        self.prepared = PreparedReference((ref_latent,), ref_context, "benchmark-reference")
        self.refkv: RefKV = self.encode()

    def encode(self) -> RefKV:
        return self.renderer._run_reference_stream(self.prepared, self.grid)

    def settings(self, name: str) -> RenderSettings:
        g = self.geo.dit
        return RenderSettings(width=g.width_px, height=g.height_px, cfg=CFG, **SETTINGS[name][0])

    def step_fn(self, name: str) -> Callable[[], torch.Tensor]:
        """One sampling step of setting `name`, as Renderer._render_batch's `denoise` closure runs it."""
        s = self.settings(name)
        has_reference = SETTINGS[name][1]
        renderer = self.renderer
        # As _render_batch: one reader per render (its RefReads are built once, not once per step).
        reader = renderer.adapter.reader(s) if has_reference else None
        refkv = self.refkv if has_reference else None
        combine = Combiner(s)

        @torch.inference_mode()
        def step() -> torch.Tensor:
            plan = step_rows(s, float(self.sigma), has_reference)
            step_kv = refkv
            if has_reference and s.recompute_reference_every_step:
                step_kv = renderer._run_reference_stream(self.prepared, self.grid)  # the pilot-style baseline
            denoised = renderer.denoise_rows(self.x, self.sigma, plan, self.ctx_for, step_kv, reader)
            return combine(self.x, self.sigma, plan, denoised)

        return step

    def plan(self, name: str) -> tuple[int, int]:
        """(rows, reading rows) of setting `name`'s step."""
        plan = step_rows(self.settings(name), SIGMA, SETTINGS[name][1])
        return len(plan.rows), sum(plan.reads)

    # -- FLOP model ---------------------------------------------------------------------------
    def encode_flops(self) -> float:
        g = self.geo.dit
        ranks = {path: self.geo.ref_rank for path in block_linear_dims(g.config)}
        return dit_forward_flops(
            g.config,
            rows=1,
            tokens=self.geo.ref_tokens,
            context_rows=g.context_rows,
            lora_ranks=ranks,
            final_layer=False,
        )

    def step_flops(self, name: str) -> float:
        g = self.geo.dit
        rows, reading = self.plan(name)
        has_reference = SETTINGS[name][1]
        flops = dit_forward_flops(
            g.config,
            rows=rows,
            tokens=g.tokens,
            context_rows=g.context_rows,
            reading_rows=reading,
            ref_tokens=self.geo.ref_tokens if reading else 0,
            lora_ranks={"self_attn.q_proj": self.geo.target_rank} if has_reference else None,
        )
        if SETTINGS[name][0].get("recompute_reference_every_step"):
            flops += self.encode_flops()
        return flops


def profile_steps(bench: StepBench, names: list[str], top: int) -> dict[str, list[dict[str, Any]]]:
    """torch.profiler over one step of each setting: the top ops by self time (also printed on stderr)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.device.type == "cuda" else [])
    result: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        fn = bench.step_fn(name)
        fn()
        with profile(activities=activities) as prof:
            time_once(fn, bench.device)
        averages = prof.key_averages()
        sort_key = "self_device_time_total" if bench.device.type == "cuda" else "self_cpu_time_total"
        log(f"--- profile of one {name} step ---\n{averages.table(sort_by=sort_key, row_limit=top)}")
        rows = sorted(averages, key=lambda e: getattr(e, sort_key), reverse=True)[:top]
        total = sum(getattr(e, sort_key) for e in averages)
        result[name] = [
            {
                "op": e.key,
                "calls": e.count,
                "self_ms": getattr(e, sort_key) / 1e3,
                "share": getattr(e, sort_key) / total if total else 0.0,
            }
            for e in rows
        ]
    return result


def build_table(
    bench: StepBench, times: dict[str, list[float]], cpu_times: dict[str, list[float]] | None, rounds: int
) -> dict[str, Any]:
    """The JSON table: per setting, per target, encode and RefKV figures (see FIELDS)."""
    base = times["no_reference"]
    base_flops = bench.step_flops("no_reference")
    settings: dict[str, Any] = {}
    for name in SETTINGS:
        summary = summarize(times[name])
        rows, reading = bench.plan(name)
        flops = bench.step_flops(name)
        settings[name] = {
            "rows": rows,
            "reading_rows": reading,
            "seconds_per_step": summary["median_s"],
            "seconds_min": summary["min_s"],
            "seconds_max": summary["max_s"],
            "ratio_to_no_reference": paired_ratio(times[name], base),
            "flop_ratio_to_no_reference": flops / base_flops,
            "gflop_per_step": flops / 1e9,
            "gflops": flops / summary["median_s"] / 1e9,
        }
        if cpu_times is not None:
            settings[name]["cpu_seconds_per_step"] = summarize(cpu_times[name])["median_s"]
            settings[name]["cpu_ratio_to_no_reference"] = paired_ratio(cpu_times[name], cpu_times["no_reference"])

    flops = {n: bench.step_flops(n) for n in SETTINGS}

    def target(numerator: str, denominator: str, limit: float, at_most: bool) -> dict[str, Any]:
        measured = paired_ratio(times[numerator], times[denominator])
        result = {
            "measured": measured,
            "limit": limit,
            "flop_model": flops[numerator] / flops[denominator],
            "met": measured <= limit if at_most else measured >= limit,
            # The least-disturbed rounds: a check on the median on a shared machine.
            "measured_from_minimums": min(times[numerator]) / min(times[denominator]),
        }
        if cpu_times is not None:  # process CPU time: leaves out descheduled time (see common.time_once)
            result["measured_cpu_time"] = paired_ratio(cpu_times[numerator], cpu_times[denominator])
        return result

    targets = {
        "snapref_default_over_no_reference": target("snapref_default", "no_reference", 1.12, at_most=True),
        "recompute_over_cached": target("recompute_every_step", "snapref_default", 1.4, at_most=False),
        "ref_guidance_over_snapref_default": target("ref_guidance", "snapref_default", 1.6, at_most=True),
    }
    encode = summarize(times[ENCODE])
    g = bench.geo.dit
    return {
        "benchmark": "snapref_steps",
        "geometry": {
            **g.describe(),
            "name": g.name,
            "ref_width_px": bench.geo.ref_width_px,
            "ref_height_px": bench.geo.ref_height_px,
            "ref_tokens": bench.geo.ref_tokens,
            "ref_rank": bench.geo.ref_rank,
            "target_rank": bench.geo.target_rank,
            "cfg": CFG,
            "ref_guidance": REF_GUIDANCE,
        },
        "device": bench.device.type,
        "dtype": str(bench.dtype).removeprefix("torch."),
        "rounds": rounds,
        "settings": settings,
        "encode_seconds": encode["median_s"],
        "encode_gflop": bench.encode_flops() / 1e9,
        "refkv_bytes": bench.refkv.nbytes,
        "refkv_dtype": str(bench.refkv.dtype).removeprefix("torch."),
        "targets": targets,
        "environment": environment(bench.device, bench.dtype),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", help="cpu (scaled geometry) or cuda (real size, bf16)")
    p.add_argument("--geometry", choices=("scaled", "real"), default=None, help="default: scaled on CPU, real on CUDA")
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="sampling dtype (default fp32 on CPU, bf16 on CUDA)",
    )
    p.add_argument("--rounds", type=int, default=7, help="timed rounds, each setting once per round (default 7)")
    p.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile one step of each setting (torch.profiler; tables on stderr, top ops in JSON)",
    )
    p.add_argument("--profile-top", type=int, default=12, help="ops per profiled setting (default 12)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--compact", action="store_true", help="print the table on one line")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 1 round: checks the script, measures nothing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure every setting side by side; print and return the table."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.smoke:
        geometry_name, args.rounds, args.warmup_rounds = "smoke", 1, 1
    else:
        geometry_name = args.geometry or ("real" if device.type == "cuda" else "scaled")
    geo = GEOMETRIES[geometry_name]
    log(
        f"building {geometry_name}: width {geo.dit.model_channels}, {geo.dit.num_blocks} blocks, "
        f"{geo.dit.tokens} target + {geo.ref_tokens} reference tokens, {dtype} on {device} ..."
    )
    bench = StepBench(geo, device, dtype)
    cases: dict[str, Callable[[], Any]] = {name: bench.step_fn(name) for name in SETTINGS}
    cases[ENCODE] = bench.encode
    log(f"timing {len(cases)} cases x {args.rounds} rounds (+{args.warmup_rounds} warm-up) ...")
    load_before = environment(device, dtype).get("load_average_1min")
    cpu_times: dict[str, list[float]] = {}
    times = interleaved(cases, device, rounds=args.rounds, warmup_rounds=args.warmup_rounds, cpu_times=cpu_times)
    table = build_table(bench, times, cpu_times if device.type == "cpu" else None, args.rounds)
    if load_before is not None:
        table["environment"]["load_average_1min_before"] = load_before
    if args.profile:
        table["profile"] = profile_steps(bench, list(SETTINGS), args.profile_top)
    return emit(table, indent=None if args.compact else 2)


if __name__ == "__main__":
    main(sys.argv[1:])
