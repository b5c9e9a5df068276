"""What the step cache costs and saves per sampling loop: the gpu_suite's "Step cache" rows.

The cache (snapref_ray/sampling/step_cache.py) skips an image's DiT forward at a step when the change it
predicts for the output stays under its threshold. How often that happens depends on the weights (random
weights move unlike Anima's), so the suite does not report a skip rate. It reports the two figures a
skip rate turns into a speed-up, measured on the suite's SnapRef default step, interleaved:

- the bookkeeping of a step that runs: a loop at threshold 0 (the cache decides at every step and
  never skips) against the loop without the cache;
- what a skipped step costs: a loop at an unreachable threshold (every step in the cache's window that
  can reuse deltas skips) against the loop without the cache, per forward skipped.

With these, a job's `step_cache.forwards_saved / forwards` (summary.json) gives its sampling time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import interleaved, log, paired_ratio, summarize
from benchmarks.suite_rows import SuiteContext
from snapref_ray.requests import StepCache
from snapref_ray.sampling.ref_guidance import Combiner, step_rows
from snapref_ray.sampling.samplers import sample
from snapref_ray.sampling.schedules import get_sigmas
from snapref_ray.sampling.step_cache import StepCacheState

LOOP_STEPS = 12  # the window (0.15-0.95 of the schedule) holds 9 of them
NEVER_SKIP = StepCache(threshold=0.0)
# Above the threshold users may set (3): built unvalidated, the benchmark's own probe of a skipped step.
ALWAYS_SKIP = StepCache.model_construct(threshold=1e9)


def _loop(ctx: SuiteContext, rule: StepCache | None, skipped: list[int]) -> Callable[[], torch.Tensor]:
    """A LOOP_STEPS euler loop of the SnapRef default step (the engine's denoise_rows), with `rule`'s cache."""
    bench = ctx.bench
    settings = bench.settings("snapref_default")
    renderer, combine = bench.renderer, Combiner(settings)
    reader = renderer.adapter.reader(settings)
    sigmas = get_sigmas(settings.scheduler, LOOP_STEPS)

    @torch.inference_mode()
    def run() -> torch.Tensor:
        cache = StepCacheState(rule, bench.batch) if rule is not None else None

        def denoise(x_B: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            plan = step_rows(settings, float(sigma), True)
            denoised = renderer.denoise_rows(x_B, sigma, plan, bench.ctx_for, bench.refkv, reader, cache)
            return combine(x_B, sigma, plan, denoised)

        x = sample(denoise, bench.x, sigmas, sampler="euler")
        if cache is not None:
            skipped[:] = cache.skipped
        return x

    return run


def step_cache_rows(ctx: SuiteContext) -> dict[str, Any]:
    """Seconds per loop without the cache, at threshold 0 and at an unreachable threshold; the derived costs."""
    skipped: dict[str, list[int]] = {"never": [], "always": []}
    cases = {
        "off": _loop(ctx, None, []),
        "never": _loop(ctx, NEVER_SKIP, skipped["never"]),
        "always": _loop(ctx, ALWAYS_SKIP, skipped["always"]),
    }
    log(f"gpu_suite: step-cache rows ({LOOP_STEPS}-step loops), {ctx.args.rounds} rounds")
    times = interleaved(cases, ctx.device, rounds=ctx.args.rounds, warmup_rounds=1)
    off, always = summarize(times["off"])["median_s"], summarize(times["always"])["median_s"]
    saved = skipped["always"][0] if skipped["always"] else 0
    ran = LOOP_STEPS - saved
    forward = off / LOOP_STEPS  # one step of the loop without the cache
    return {
        "loop steps": LOOP_STEPS,
        "off s/loop": round(off, 5),
        "threshold 0 x off (bookkeeping of steps that run)": round(paired_ratio(times["never"], times["off"]), 4),
        "threshold 0 forwards skipped": skipped["never"][0] if skipped["never"] else 0,
        "all-skip forwards skipped": saved,
        "all-skip x off": round(paired_ratio(times["always"], times["off"]), 4),
        # The loop that skips `saved` steps, less its `ran` full steps, is what the skipped steps cost.
        "skipped step x full step": round(max(always - ran * forward, 0.0) / max(saved, 1) / forward, 4),
    }
