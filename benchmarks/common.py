"""Shared helpers of the benchmarks: geometries, timing, machine info, JSON output.

Timing rules (every benchmark here follows them):
- warm-up calls first (first calls allocate, pick kernels, fault in memory-mapped weights);
- then repeats, and the **median** is the figure (robust to a noisy, shared machine);
- settings that are compared with each other are measured **interleaved** (`interleaved`): each
  round runs every setting once, in an order rotated every round, so drift and load from other
  processes land on all settings alike.

FLOP counts come from the package's FLOP model (`snapref_ray/models/flops.py`, matmuls only), so
"achieved GFLOP/s" is a slight under-estimate of the machine's work rate.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from snapref_ray.geometry import VAE_SCALE, token_count
from snapref_ray.models.conditioning import CONTEXT_ROWS
from snapref_ray.models.dit import AnimaDiT, load_dit
from snapref_ray.models.dit_config import DiTConfig
from snapref_ray.models.tiny_dit import T5_VOCAB, make_tiny_dit_state_dict, tiny_dit_config
from snapref_ray.platform_info import cpu_model


def tokens_for(width_px: int, height_px: int) -> int:
    """Target tokens of a width x height image (sides multiples of geometry.PIXELS_PER_TOKEN)."""
    return token_count(height=height_px, width=width_px)


# --- geometries and models ------------------------------------------------------------------


@dataclass(frozen=True)
class DiTGeometry:
    """A DiT shape plus the token counts one benchmark runs it at.

    Built through the real loader (`load_dit` on a `make_tiny_dit_state_dict` state dict, random
    seeded weights in the real key layout), so every size runs exactly the code a real file does.
    """

    name: str
    model_channels: int
    head_dim: int
    num_blocks: int
    context_dim: int  # cross-attention context width (= LLM adapter width)
    context_rows: int  # context rows per batch row (the real text path pads to 512)
    adaln_lora_dim: int
    adapter_heads: int  # LLM adapter (not run by these benchmarks; only its shape must be valid)
    adapter_blocks: int
    t5_vocab: int
    width_px: int  # target image size
    height_px: int

    @property
    def tokens(self) -> int:
        return tokens_for(self.width_px, self.height_px)

    @property
    def latent_hw(self) -> tuple[int, int]:
        return self.height_px // VAE_SCALE, self.width_px // VAE_SCALE

    @property
    def config(self) -> DiTConfig:
        """The DiTConfig `build_dit` makes (for FLOP counts and sizes without building anything)."""
        return tiny_dit_config(
            model_channels=self.model_channels,
            num_blocks=self.num_blocks,
            head_dim=self.head_dim,
            context_dim=self.context_dim,
            adaln_lora_dim=self.adaln_lora_dim,
            adapter_dim=self.context_dim,
            adapter_heads=self.adapter_heads,
            adapter_blocks=self.adapter_blocks,
            t5_vocab=self.t5_vocab,
        )

    def with_blocks(self, num_blocks: int) -> DiTGeometry:
        return replace(self, num_blocks=num_blocks)

    def with_size(self, width_px: int, height_px: int) -> DiTGeometry:
        return replace(self, width_px=width_px, height_px=height_px)

    def describe(self) -> dict[str, Any]:
        return {
            "model_channels": self.model_channels,
            "num_heads": self.model_channels // self.head_dim,
            "head_dim": self.head_dim,
            "mlp_hidden": 4 * self.model_channels,
            "blocks": self.num_blocks,
            "context_dim": self.context_dim,
            "context_rows": self.context_rows,
            "adaln_lora_dim": self.adaln_lora_dim,
            "width_px": self.width_px,
            "height_px": self.height_px,
            "tokens": self.tokens,
        }


# Anima at real size (2048 wide, 16 x 128 heads, MLP 8192, context 512 x 1024), at 832x1216 px (3,952 tokens).
REAL = DiTGeometry(
    name="real",
    model_channels=2048,
    head_dim=128,
    num_blocks=28,
    context_dim=1024,
    context_rows=CONTEXT_ROWS,
    adaln_lora_dim=256,
    adapter_heads=16,
    adapter_blocks=6,
    t5_vocab=T5_VOCAB,
    width_px=832,
    height_px=1216,
)
# Width-scaled: every length divided by 4 (width 512 = 4 x 128 heads, MLP 2048, 988 tokens = a quarter of
# 3,952, context 128 rows x 256, adaLN bottleneck 64). Every FLOP term of a forward (linears ~ L*D^2,
# attention ~ L^2*D, cross-attention ~ L*S*D, context projections ~ S*C*D) then shrinks by exactly 64, so
# the balance between attention and linear work (and the reference's share of it) is the real one.
SCALED = DiTGeometry(
    name="scaled",
    model_channels=512,
    head_dim=128,
    num_blocks=28,
    context_dim=256,
    context_rows=128,
    adaln_lora_dim=64,
    adapter_heads=4,
    adapter_blocks=1,
    t5_vocab=1024,
    width_px=416,
    height_px=608,
)
# For the smoke tests: every code path, in milliseconds.
SMOKE = DiTGeometry(
    name="smoke",
    model_channels=64,
    head_dim=32,
    num_blocks=2,
    context_dim=32,
    context_rows=8,
    adaln_lora_dim=16,
    adapter_heads=2,
    adapter_blocks=1,
    t5_vocab=64,
    width_px=64,
    height_px=48,
)


def build_dit(geometry: DiTGeometry, *, device: torch.device, dtype: torch.dtype, seed: int = 0) -> AnimaDiT:
    """Random seeded weights at `geometry`'s shape, loaded through `load_dit` onto device/dtype."""
    sd = make_tiny_dit_state_dict(
        model_channels=geometry.model_channels,
        num_blocks=geometry.num_blocks,
        head_dim=geometry.head_dim,
        context_dim=geometry.context_dim,
        adaln_lora_dim=geometry.adaln_lora_dim,
        adapter_dim=geometry.context_dim,
        adapter_heads=geometry.adapter_heads,
        adapter_blocks=geometry.adapter_blocks,
        t5_vocab=geometry.t5_vocab,
        seed=seed,
        dtype=dtype,
    )
    dit = load_dit(sd, dtype=dtype, device=device)
    del sd
    return dit


def dit_parameter_bytes(geometry: DiTGeometry, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of one block, bytes of everything else) of the DiT at `geometry`, counted on the meta device."""
    with torch.device("meta"):
        model = AnimaDiT(geometry.with_blocks(1).config)
    size = torch.empty((), dtype=dtype).element_size()
    block = sum(p.numel() for p in model.blocks[0].parameters()) * size
    total = sum(p.numel() for p in model.parameters()) * size
    return block, total - block


# --- timing ----------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock times cover it (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], Any], device: torch.device, cpu_seconds: list[float] | None = None) -> float:
    """Wall-clock seconds one call of fn takes, device work included.

    With `cpu_seconds`, also appends the process CPU time of the call (all threads): on a shared
    machine it leaves out the time this process was descheduled, so with one torch thread it is a
    steadier measure of the work than wall time (with several, idle threads' spin-waits count too).
    """
    synchronize(device)
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    synchronize(device)
    t1, c1 = time.perf_counter(), time.process_time()
    if cpu_seconds is not None:
        cpu_seconds.append(c1 - c0)
    return t1 - t0


def interleaved(
    cases: Mapping[str, Callable[[], Any]],
    device: torch.device,
    *,
    rounds: int,
    warmup_rounds: int = 1,
    cpu_times: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Time every case once per round, the order rotated each round; returns wall seconds per case, by round.

    Round r runs the cases starting at index r mod n, so over n rounds every case has held every
    position (what runs just before a case can change its caches and its clock speed).
    `cpu_times`, if given, receives the process CPU seconds of the same calls, by case.
    """
    names = list(cases)
    times: dict[str, list[float]] = {name: [] for name in names}
    if cpu_times is not None:
        cpu_times.update({name: [] for name in names})
    for r in range(warmup_rounds + rounds):
        k = r % len(names)
        timed = r >= warmup_rounds
        for name in names[k:] + names[:k]:
            seconds = time_once(cases[name], device, cpu_times[name] if cpu_times is not None and timed else None)
            if timed:
                times[name].append(seconds)
    return times


def summarize(seconds: list[float]) -> dict[str, float]:
    """Median (the figure), min, max and count of a list of timings."""
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds), "n": len(seconds)}


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of numerator[r] / denominator[r]: a ratio of interleaved timings, robust to drift."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


# --- machine ---------------------------------------------------------------------------------


def environment(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """What a figure was measured on: device, dtype, versions, threads, load."""
    env: dict[str, Any] = {
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if hasattr(os, "getloadavg"):
        env["load_average_1min"] = round(os.getloadavg()[0], 2)
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def parse_dtype(name: str) -> torch.dtype:
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of {', '.join(dtypes)}, found {name!r}")
    return dtypes[name]


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: no CUDA device is available on this machine")
    return device


# --- output ----------------------------------------------------------------------------------


def _round(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_round(v) for v in value]
    return value


def emit(record: Mapping[str, Any], *, indent: int | None = None) -> dict[str, Any]:
    """Print one record as JSON (one line unless `indent`) on stdout; returns it as printed (6 digits)."""
    printed = _round(dict(record))
    print(json.dumps(printed, indent=indent), flush=True)
    return printed


def log(message: str) -> None:
    """Progress on stderr, so stdout stays pure JSON."""
    print(message, file=sys.stderr, flush=True)
