import pytest
import torch

from snapref_ray.requests import RenderSettings
from snapref_ray.sampling.ref_guidance import Combiner, Row, in_ref_window, plan_step


def test_default_path_cond_reads_uncond_does_not():
    plan = plan_step(RenderSettings(), 0.5, has_reference=True)
    assert plan.rows == (Row.COND, Row.UNCOND) and plan.reads == (True, False)
    assert not plan.ref_guidance_active


def test_ref_in_uncond_makes_the_uncond_row_read():
    plan = plan_step(RenderSettings(ref_in_uncond=True), 0.5, has_reference=True)
    assert plan.reads == (True, True)


def test_cfg_one_skips_the_uncond_row():
    assert plan_step(RenderSettings(cfg=1.0), 0.5, True).rows == (Row.COND,)
    assert plan_step(RenderSettings(cfg=1.0), 0.5, False).rows == (Row.COND,)


def test_ref_guidance_adds_a_no_reference_row_inside_the_window_only():
    s = RenderSettings(ref_guidance=2.0, ref_end=0.6)
    inside = plan_step(s, 0.9, True)
    assert inside.rows == (Row.COND, Row.UNCOND, Row.COND_NOREF)
    assert inside.reads == (True, True, False) and inside.ref_guidance_active
    outside = plan_step(s, 0.3, True)  # past 60% of the schedule: sigma below shift3(0.4) = 0.667
    assert outside.rows == (Row.COND, Row.UNCOND) and outside.reads == (True, True)


def test_window_is_compared_in_sigma():
    s = RenderSettings(ref_start=0.2, ref_end=0.6)
    # percent_to_sigma(p) = shift3(1 - p): 0.2 -> 0.9231, 0.6 -> 0.6667
    assert not in_ref_window(s, 0.95)
    assert in_ref_window(s, 0.8)
    assert not in_ref_window(s, 0.6)


def test_combine_matches_the_design_formula_without_correction():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 1, 4, 4, generator=g)
    dc, du, dn = (torch.randn(1, 16, 1, 4, 4, generator=g) for _ in range(3))
    s = RenderSettings(cfg=4.5, ref_guidance=1.8, correction="none")
    plan = plan_step(s, 0.9, True)
    out = Combiner(s)(x, torch.tensor(0.9), plan, {Row.COND: dc, Row.UNCOND: du, Row.COND_NOREF: dn})
    expected = du + 4.5 * (dc - du) + 0.8 * (dc - dn)
    assert torch.allclose(out, expected, atol=1e-6)


@pytest.mark.parametrize("correction", ["apg", "rescale"])
def test_corrections_change_only_the_guided_estimate(correction):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 1, 4, 4, generator=g)
    dc, du, dn = (torch.randn(1, 16, 1, 4, 4, generator=g) * 3 for _ in range(3))
    s_none = RenderSettings(cfg=4.0, ref_guidance=3.0, correction="none")
    s_corr = RenderSettings(cfg=4.0, ref_guidance=3.0, correction=correction)
    plan = plan_step(s_none, 0.9, True)
    rows = {Row.COND: dc, Row.UNCOND: du, Row.COND_NOREF: dn}
    plain = Combiner(s_none)(x, torch.tensor(0.9), plan, rows)
    corrected = Combiner(s_corr)(x, torch.tensor(0.9), plan, rows)
    assert torch.isfinite(corrected).all()
    assert not torch.allclose(plain, corrected)
    # Without the reference row the correction has nothing to act on.
    plan_default = plan_step(RenderSettings(cfg=4.0), 0.9, True)
    base = {Row.COND: dc, Row.UNCOND: du}
    assert torch.equal(Combiner(RenderSettings(cfg=4.0, correction=correction))(x, torch.tensor(0.9), plan_default, base),
                       Combiner(RenderSettings(cfg=4.0, correction="none"))(x, torch.tensor(0.9), plan_default, base))
