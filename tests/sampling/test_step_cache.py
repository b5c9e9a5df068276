"""The per-image step cache (ComfyUI's EasyCache rule, sampling/step_cache.py) in real renders on the tiny model.

The tiny model's pictures are noise, so nothing here judges quality: the tests check the rule's plumbing —
threshold 0 changes nothing, a skipping image gets exactly its last deltas, images of a batch decide alone,
skipped rows leave the forward, reference and ref-guidance rows follow, one host read per step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from snapref_ray.requests import RenderRequest, RenderSettings, StepCache
from snapref_ray.sampling.ref_guidance import Row, step_rows
from snapref_ray.sampling.schedules import get_sigmas, percent_to_sigma
from snapref_ray.sampling.step_cache import StepCacheState
from tests.test_host_reads import recorded  # noqa: F401  (the fixture)

BASE = {"width": 256, "height": 256, "steps": 16, "sampler": "euler"}


@pytest.fixture(scope="module")
def refkv(tiny_renderer, tiny_models: Path):
    return tiny_renderer.encode_reference((tiny_models / "reference.png").read_bytes(), width=256, height=256)


def _render(renderer, refkv, step_cache, prompts=("1girl, beach",), seeds=(1,), **settings):
    s = RenderSettings(**{**BASE, **settings}, step_cache=step_cache)
    return renderer.render([RenderRequest(prompt=p, seed=i, settings=s) for p, i in zip(prompts, seeds)], refkv=refkv)


def _pixels(result) -> np.ndarray:
    return np.asarray(result.image, dtype=np.int16)


@pytest.mark.parametrize("settings", [{}, {"ref_guidance": 1.5}, {"sampler": "er_sde", "ref_in_uncond": True}])
def test_threshold_zero_is_bitwise_the_uncached_render(tiny_renderer, refkv, settings):
    off = _render(tiny_renderer, refkv, None, **settings)[0]
    zero = _render(tiny_renderer, refkv, {"threshold": 0.0}, **settings)[0]
    assert np.array_equal(_pixels(off), _pixels(zero))
    assert (off.skipped_forwards, zero.skipped_forwards) == (None, 0)


def test_comfyuis_defaults_skip_forwards_inside_the_window_only(tiny_renderer, refkv):
    (on,) = _render(tiny_renderer, refkv, True)
    sigmas = get_sigmas("simple", BASE["steps"])[:-1].tolist()
    window = [s for s in sigmas if percent_to_sigma(0.95) < s <= percent_to_sigma(0.15)]
    # Two full forwards in the window come first (the second measures the transformation rate).
    assert 0 < on.skipped_forwards <= len(window) - 2
    assert on.request.settings.step_cache == StepCache()


def test_a_skipping_row_gets_exactly_its_last_delta(tiny_renderer, refkv):
    """denoise_rows at consecutive steps, with a rule that skips whenever it can: the skipped step's
    denoised rows equal x - sigma * (x + (v_last - x_last)), v_last computed here by a plain forward."""
    r = tiny_renderer
    s = RenderSettings(**BASE, ref_guidance=1.5, step_cache={"threshold": 3.0, "start": 0.0, "end": 1.0})
    contexts = [r.prompts.encode(p, device=r.device) for p in ("1girl", "")]
    ctx_for = {Row.COND: contexts[:1], Row.UNCOND: contexts[1:], Row.COND_NOREF: contexts[:1]}
    reader = r.adapter.reader(r.resolve(s))
    cache = StepCacheState(s.step_cache, 1)
    sigmas = get_sigmas("simple", 16).tolist()
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, 16, 1, 32, 32, generator=gen) * (1.0 - 0.05 * i) for i in range(4)]
    outputs = []
    for step, x in enumerate(xs):
        plan = step_rows(r.resolve(s), sigmas[step], True)
        runs_before = sum(c.skipped for c in cache._state)
        denoised = r.denoise_rows(x, sigmas[step], plan, ctx_for, refkv, reader, cache)
        skipped = sum(c.skipped for c in cache._state) > runs_before
        outputs.append((x, plan, denoised, skipped))
    # Steps 0 and 1 run (no rate yet); step 2 may skip under a threshold of 3.
    assert [o[3] for o in outputs[:2]] == [False, False] and outputs[2][3]
    x_last, plan_last = outputs[1][0], outputs[1][1]
    v_last = r._velocities(x_last, sigmas[1], plan_last, ctx_for, refkv, reader)  # the last full forward, again
    x, plan, denoised, _ = outputs[2]
    for row in plan.rows:
        expected = x - sigmas[2] * (x + (v_last[row] - x_last))
        torch.testing.assert_close(denoised[row], expected, rtol=0, atol=1e-6)


def test_images_of_a_batch_decide_alone(tiny_renderer, refkv):
    prompts, seeds = ("1girl, beach", "1boy, rain, night"), (1, 2)
    both = _render(tiny_renderer, refkv, True, prompts, seeds)
    alone = [_render(tiny_renderer, refkv, True, (p,), (i,))[0] for p, i in zip(prompts, seeds)]
    assert [b.skipped_forwards for b in both] == [a.skipped_forwards for a in alone]
    for b, a in zip(both, alone):  # a batch row equals its single render up to the kernels' rounding
        assert np.abs(_pixels(b) - _pixels(a)).max() <= 1


def test_skipped_rows_do_not_run(tiny_renderer, refkv, monkeypatch):
    """Counted at the DiT: each forward's rows. An image that skips contributes none of its rows."""
    rows_seen: list[int] = []
    real_forward = tiny_renderer.forward

    def counting(x, *args, **kwargs):
        rows_seen.append(x.shape[0])
        return real_forward(x, *args, **kwargs)

    monkeypatch.setattr(tiny_renderer, "forward", counting)
    rule = {"threshold": 0.5, "start": 0.0, "end": 1.0}
    results = _render(tiny_renderer, refkv, rule, ("1girl, beach", "1boy, rain, night"), (1, 2), ref_guidance=1.5)
    skipped = sum(r.skipped_forwards for r in results)
    rows_per_image = 3  # cond, uncond and the ref-guidance row, in every step of this schedule
    assert skipped > 0
    # The plain and the reading rows may run as separate forwards (a kind's sub-batches): count rows, not calls.
    assert sum(rows_seen) == rows_per_image * (2 * BASE["steps"] - skipped)


def test_one_host_read_per_step_inside_the_window(tiny_renderer, refkv, recorded):  # noqa: F811
    recorder, _ = recorded
    (result,) = _render(tiny_renderer, refkv, True, sampler="er_sde", ref_guidance=1.5)
    sigmas = get_sigmas("simple", BASE["steps"])[:-1].tolist()
    inside = [s for s in sigmas if percent_to_sigma(0.95) < s <= percent_to_sigma(0.15)]
    reads = recorder.offending()  # reads of anything but the host schedule: the cache's decisions only
    assert 0 < len(reads) <= len(inside) and all(r.startswith("tolist of a (1,") for r in reads), reads
    assert result.skipped_forwards > 0


def test_the_setting_parses_the_shorthands_of_every_front_door():
    assert RenderSettings(step_cache="on").step_cache == StepCache()
    assert RenderSettings(step_cache=0.3).step_cache == StepCache(threshold=0.3)
    assert RenderSettings(step_cache='{"threshold": 0.1, "end": 0.5}').step_cache == StepCache(threshold=0.1, end=0.5)
    assert RenderSettings(step_cache="off").step_cache is None and RenderSettings().step_cache is None
    with pytest.raises(ValueError, match="step_cache: expected on/off, a threshold or a JSON object"):
        RenderSettings(step_cache="sometimes")
    with pytest.raises(ValueError, match="must not exceed its end"):
        RenderSettings(step_cache={"start": 0.9, "end": 0.2})
    # Part of what must agree to share a forward, and hashable like the rest of the key.
    assert RenderSettings(step_cache=True).batch_key() != RenderSettings().batch_key()
    hash(RenderSettings(step_cache=True).batch_key())
