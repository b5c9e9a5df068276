"""Benchmark: ArcAnima v2's LoRA where only some rows of a CFG batch read, three ways.

One v2 DiT forward over a step's rows, the cached reference read by the reading rows and the
LoRA (x 1) carried by them, computed three ways side by side:

- `every_row_scaled`: the delta computed for every row and multiplied by 0 where a row does not
  read (what the engine did before v2's LoRA moved to the reading rows; kept here as the comparison);
- `gathered`: one forward, the delta computed on the reading rows only (gathered as slices) and
  put back among zero rows (`RowLoRA` below: the alternative measured);
- `sub_batches`: the reading rows and the others as two forwards of the step, the LoRA and the
  read in the first only (adapter/arcanima_v2.V2Reader: what the engine runs).

Row layouts: `one_of_two` (ref_in_uncond false with ref_guidance 1: cond reads, uncond does not),
`two_of_two` (both CFG rows read) and `two_of_three` (ref_guidance: cond and uncond read, the
extra cond row does not). Every form of a layout must give the same velocities (checked, fp32).

Geometry: on the CPU, `scaled` (benchmarks/common.py: width 512, 988 target tokens, context 128
x 256) with a 512x512 px reference (1,024 tokens) and LoRA rank 16, the published 64 / 4, so the
LoRA's share of a forward is the real one; `--rank 64` is the published rank at this width (4x
the real share). Blocks all have the same work, so `--blocks` fewer than 28 changes no ratio.
Timed interleaved (common.interleaved); ratios are medians of per-round ratios, of wall time and,
on the CPU, of process CPU time (with `--threads 1` the steadier figure on a shared machine).
Matmul FLOPs of each form come from torch's FlopCounterMode.

    python -m benchmarks.v2_lora_rows                # CPU, scaled, rank 16, 28 blocks
    python -m benchmarks.v2_lora_rows --threads 1 --blocks 4 --rounds 7 --rank 64
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import (
    REAL,
    SCALED,
    SMOKE,
    build_dit,
    emit,
    environment,
    interleaved,
    log,
    paired_ratio,
    parse_dtype,
    resolve_device,
    summarize,
)
from snapref_ray.adapter.arcanima import make_arcanima
from snapref_ray.adapter.arcanima_v2 import ArcAnimaV2
from snapref_ray.adapter.reference_adapter import PreparedReference
from snapref_ray.models.attention import row_runs, take_rows
from snapref_ray.models.geometry import latent_size
from snapref_ray.models.ops import LoRAPair
from snapref_ray.requests import RenderSettings

GEOMETRIES = {"scaled": (SCALED, 512), "real": (REAL, 1024), "smoke": (SMOKE, 64)}  # (DiT, reference side px)
LAYOUTS = {"one_of_two": (True, False), "two_of_two": (True, True), "two_of_three": (True, True, False)}
FORMS = ("every_row_scaled", "gathered", "sub_batches")
SIGMA = 0.5


@dataclass(frozen=True)
class RowScaledLoRA:
    """The engine's former v2 LoRA: the delta of every row, x 0 in rows that do not read."""

    pair: LoRAPair
    row_scale_B: torch.Tensor

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.row_scale_B.to(device=x.device, dtype=x.dtype).reshape(-1, *[1] * (x.ndim - 1))
        return self.pair.delta(x) * scale


@dataclass(frozen=True)
class RowLoRA:
    """The delta computed in batch rows `rows` only (sorted host ints), zero rows elsewhere: one forward."""

    pair: LoRAPair
    rows: tuple[int, ...]

    def delta(self, x_BLI: torch.Tensor) -> torch.Tensor:
        B = x_BLI.shape[0]
        if len(self.rows) == B:
            return self.pair.delta(x_BLI)
        runs = row_runs(self.rows)
        delta_RLO = self.pair.delta(take_rows(x_BLI, runs))
        pieces, start, offset = [], 0, 0
        for a, b in runs:
            if a > start:
                pieces.append(delta_RLO.new_zeros(a - start, *delta_RLO.shape[1:]))
            pieces.append(delta_RLO[offset : offset + b - a])
            offset, start = offset + b - a, b
        if start < B:
            pieces.append(delta_RLO.new_zeros(B - start, *delta_RLO.shape[1:]))
        return torch.cat(pieces)


class V2Forms:
    """One v2 step's forward at a geometry, in each of the three forms."""

    def __init__(self, name: str, device: torch.device, dtype: torch.dtype, *, rank: int, blocks: int | None) -> None:
        geo, ref_side = GEOMETRIES[name]
        geo = geo.with_blocks(blocks) if blocks else geo
        self.geo, self.device, self.dtype = geo, device, dtype
        self.dit = build_dit(geo, device=device, dtype=dtype)
        adapter = make_arcanima(
            "arcanima-v2",
            num_blocks=geo.num_blocks,
            model_channels=geo.model_channels,
            context_dim=geo.context_dim,
            mlp_hidden=4 * geo.model_channels,
            rank=rank,
            seed=5,
        )
        self.bound = ArcAnimaV2.bind(adapter, geo.num_blocks, device, dtype)
        gen = torch.Generator().manual_seed(7)
        h, w = geo.latent_hw
        self.grid = self.dit.token_grid(h, w)
        ref_latent = torch.randn(1, 16, *latent_size(height=ref_side, width=ref_side), generator=gen).to(device)
        self.refkv = self.bound.reference_stream(
            self.dit, PreparedReference((ref_latent,), None, "benchmark"), self.grid, dtype
        )
        rows = max(len(reads) for reads in LAYOUTS.values())
        self.x = torch.randn(rows, 16, 1, h, w, generator=gen).to(device, dtype)
        self.ctx = torch.randn(rows, geo.context_rows, geo.context_dim, generator=gen).to(device, dtype)
        self.rank, self.ref_tokens = rank, self.refkv.num_tokens

    def step(self, form: str, reads: tuple[bool, ...]) -> Callable[[], torch.Tensor]:
        """The forward of `reads`' rows in `form` (what one CFG step of v2 runs)."""
        n = len(reads)
        x, ctx = self.x[:n], self.ctx[:n]
        sigma = torch.full((n,), SIGMA, device=self.device)
        reading = tuple(i for i, r in enumerate(reads) if r)
        refs = self.refkv.reads(reads, [1.0] * self.geo.num_blocks)
        dit = self.dit
        if form == "every_row_scaled":
            scale_B = torch.tensor(reads, device=self.device, dtype=torch.float32)
            loras = [
                None
                if k is None
                else {lin: RowScaledLoRA(p, scale_B) for lin, p in self.bound.adapter.loras[k].items()}
                for k in self.bound.hooked
            ]
            return lambda: dit(x, sigma, ctx, loras=loras, refs=refs)
        if form == "gathered":
            loras = [
                None if k is None else {lin: RowLoRA(p, reading) for lin, p in self.bound.adapter.loras[k].items()}
                for k in self.bound.hooked
            ]
            return lambda: dit(x, sigma, ctx, loras=loras, refs=refs)
        reader = self.bound.reader(RenderSettings(strength=1.0))
        return lambda: reader.forward(dit, x, sigma, ctx, reads, self.refkv)


def flops(fn: Callable[[], Any]) -> int:
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Time every form of every row layout side by side; print and return the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--geometry", choices=tuple(GEOMETRIES), default=None, help="default: scaled on CPU, real on CUDA")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="default fp32 on CPU, bf16 on CUDA")
    p.add_argument("--rank", type=int, default=None, help="v2 LoRA rank (default: 64 / 4 = 16 on scaled, 64 real)")
    p.add_argument("--blocks", type=int, default=None, help="DiT blocks (default: the geometry's 28)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup-rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 1 round: checks the script, measures nothing")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    name = "smoke" if args.smoke else args.geometry or ("real" if device.type == "cuda" else "scaled")
    rank = args.rank or {"scaled": 16, "real": 64, "smoke": 4}[name]
    rounds = 1 if args.smoke else args.rounds
    forms = V2Forms(name, device, dtype, rank=rank, blocks=args.blocks)
    log(f"v2_lora_rows: {name}, width {forms.geo.model_channels}, {forms.geo.num_blocks} blocks, rank {rank}, {dtype}")

    cases, table = {}, {}
    with torch.inference_mode():
        for layout, reads in LAYOUTS.items():
            outputs = {}
            for form in FORMS:
                fn = forms.step(form, reads)
                cases[f"{layout}/{form}"] = fn
                outputs[form] = fn().float()
            for form in FORMS[1:]:  # the three forms are one computation
                torch.testing.assert_close(outputs[form], outputs["every_row_scaled"], rtol=1e-4, atol=1e-4)
        log(f"timing {len(cases)} cases x {rounds} rounds (+{args.warmup_rounds} warm-up) ...")
        cpu_times: dict[str, list[float]] = {}
        times = interleaved(cases, device, rounds=rounds, warmup_rounds=args.warmup_rounds, cpu_times=cpu_times)
    for layout, reads in LAYOUTS.items():
        row: dict[str, Any] = {"rows": len(reads), "reading_rows": sum(reads)}
        for form in FORMS:
            case, base = f"{layout}/{form}", f"{layout}/every_row_scaled"
            row[form] = {
                "seconds": summarize(times[case])["median_s"],
                "ratio_to_every_row_scaled": paired_ratio(times[case], times[base]),
                "gflop": flops(cases[case]) / 1e9,
            }
            if device.type == "cpu":  # process CPU time: steadier than wall time on a shared machine (1 thread)
                row[form]["cpu_seconds"] = summarize(cpu_times[case])["median_s"]
                row[form]["cpu_ratio_to_every_row_scaled"] = paired_ratio(cpu_times[case], cpu_times[base])
        table[layout] = row
    return emit(
        {
            "benchmark": "v2_lora_rows",
            "geometry": forms.geo.describe() | {"ref_tokens": forms.ref_tokens, "lora_rank": rank},
            "rounds": rounds,
            "layouts": table,
            "environment": environment(device, dtype),
        },
        indent=2,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
