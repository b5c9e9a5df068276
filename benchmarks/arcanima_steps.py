"""ArcAnima's step cost beside the plain step and SnapRef's: the gpu_suite's "ArcAnima" rows.

Both published ArcAnima adapters run through the engine's own path (`Renderer._run_reference_stream`
and `Renderer.denoise_rows` with the bound ArcAnima adapter, then the `Combiner`), on the suite's
DiT with a random adapter of the published layout (rank 64 v2, rank 32 pilot, all ten linears):

- arcanima-v2: the cond row reads a cached reference K/V (the 1 MP reference of the suite) and
  carries the LoRA; the uncond row runs the base model, as a second sub-batch of the step.
- arcanima-pilot: the cond row runs [target; reference] as two latent frames with the LoRA (twice
  the tokens, full attention over both), the uncond row one frame without it: two forwards.

Timed interleaved with the suite's no-reference step, so the ratios share its conditions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import interleaved, log, paired_ratio, summarize
from benchmarks.snapref_steps import CFG, SIGMA
from benchmarks.suite_rows import SuiteContext
from snapref_ray.adapter.arcanima import BoundArcAnima, make_arcanima
from snapref_ray.adapter.kinds import ARCANIMA_KINDS, ARCANIMA_LAYOUTS
from snapref_ray.adapter.reference_adapter import PreparedReference
from snapref_ray.requests import RenderSettings
from snapref_ray.sampling.ref_guidance import Combiner, step_rows


def _arcanima_step(ctx: SuiteContext, kind: str) -> tuple[Callable[[], torch.Tensor], Callable[[], Any], BoundArcAnima]:
    """(one CFG step, the reference encode, the bound adapter) of `kind` on the suite's renderer."""
    bench, g = ctx.bench, ctx.bench.geo.dit
    adapter = make_arcanima(
        kind,
        num_blocks=g.num_blocks,
        model_channels=g.model_channels,
        context_dim=g.context_dim,
        mlp_hidden=4 * g.model_channels,
        seed=5,
    )
    bound = BoundArcAnima.bind(adapter, g.num_blocks, ctx.device, bench.dtype)
    h, w = g.latent_hw
    gen = torch.Generator().manual_seed(7)
    # v2 reads the suite's 1 MP reference; the pilot's frame must have the target's size.
    latent = (
        bench.prepared.latents[0] if kind == "arcanima-v2" else torch.randn(1, 16, h, w, generator=gen).to(ctx.device)
    )
    prepared = PreparedReference((latent,), None, f"benchmark-{kind}")
    settings = RenderSettings(width=g.width_px, height=g.height_px, cfg=CFG)
    plan = step_rows(settings, SIGMA, True)
    combine = Combiner(settings)
    renderer = bench.renderer

    def with_adapter(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            saved, renderer.adapter = renderer.adapter, bound
            try:
                return fn()
            finally:
                renderer.adapter = saved

        return run

    encode = with_adapter(lambda: renderer._run_reference_stream(prepared, bench.grid))
    refkv = encode()
    reader = bound.reader(settings.model_copy(update={"strength": 1.0}))

    @torch.inference_mode()
    def step() -> torch.Tensor:
        denoised = renderer.denoise_rows(bench.x, bench.sigma, plan, bench.ctx_for, refkv, reader)
        return combine(bench.x, bench.sigma, plan, denoised)

    return with_adapter(step), encode, bound


def arcanima_rows(ctx: SuiteContext) -> dict[str, Any]:
    """Seconds per step and ratio to the plain step for both ArcAnima kinds (+ encode seconds)."""
    cases: dict[str, Callable[[], Any]] = {"no_reference": ctx.bench.step_fn("no_reference")}
    encodes: dict[str, Callable[[], Any]] = {}
    for kind in ARCANIMA_KINDS:
        cases[kind], encodes[f"{kind} encode"], _ = _arcanima_step(ctx, kind)
    log(f"gpu_suite: ArcAnima rows ({', '.join(ARCANIMA_KINDS)}), {ctx.args.rounds} rounds")
    times = interleaved({**cases, **encodes}, ctx.device, rounds=ctx.args.rounds, warmup_rounds=1)
    rows: dict[str, Any] = {"no_reference s/step": round(summarize(times["no_reference"])["median_s"], 5)}
    for kind in ARCANIMA_KINDS:
        rows[f"{kind} s/step"] = round(summarize(times[kind])["median_s"], 5)
        rows[f"{kind} x no reference"] = round(paired_ratio(times[kind], times["no_reference"]), 3)
        rows[f"{kind} encode s"] = round(summarize(times[f"{kind} encode"])["median_s"], 5)
        rows[f"{kind} rank"] = ARCANIMA_LAYOUTS[kind].rank
    return rows
