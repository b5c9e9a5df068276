import numpy as np
import pytest
import torch

from snapref_ray.requests import RenderSettings
from snapref_ray.sampling.ref_guidance import Combiner, Row, in_ref_window, step_rows


def test_default_path_cond_reads_uncond_does_not():
    plan = step_rows(RenderSettings(), 0.5, has_reference=True)
    assert plan.rows == (Row.COND, Row.UNCOND) and plan.reads == (True, False)
    assert not plan.ref_guidance_active


def test_ref_in_uncond_makes_the_uncond_row_read():
    plan = step_rows(RenderSettings(ref_in_uncond=True), 0.5, has_reference=True)
    assert plan.reads == (True, True)


def test_cfg_one_skips_the_uncond_row():
    assert step_rows(RenderSettings(cfg=1.0), 0.5, True).rows == (Row.COND,)
    assert step_rows(RenderSettings(cfg=1.0), 0.5, False).rows == (Row.COND,)


def test_ref_guidance_adds_a_no_reference_row_inside_the_window_only():
    s = RenderSettings(ref_guidance=2.0, ref_end=0.6)
    inside = step_rows(s, 0.9, True)
    assert inside.rows == (Row.COND, Row.UNCOND, Row.COND_NOREF)
    assert inside.reads == (True, True, False) and inside.ref_guidance_active
    outside = step_rows(s, 0.3, True)  # past 60% of the schedule: sigma below shift3(0.4) = 0.667
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
    plan = step_rows(s, 0.9, True)
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
    plan = step_rows(s_none, 0.9, True)
    rows = {Row.COND: dc, Row.UNCOND: du, Row.COND_NOREF: dn}
    plain = Combiner(s_none)(x, torch.tensor(0.9), plan, rows)
    corrected = Combiner(s_corr)(x, torch.tensor(0.9), plan, rows)
    assert torch.isfinite(corrected).all()
    assert not torch.allclose(plain, corrected)
    # Without the reference row the correction has nothing to act on.
    plan_default = step_rows(RenderSettings(cfg=4.0), 0.9, True)
    base = {Row.COND: dc, Row.UNCOND: du}
    assert torch.equal(
        Combiner(RenderSettings(cfg=4.0, correction=correction))(x, torch.tensor(0.9), plan_default, base),
        Combiner(RenderSettings(cfg=4.0, correction="none"))(x, torch.tensor(0.9), plan_default, base),
    )


# --- float64 re-derivation of the combination (docs/design.md#which-rows-read-and-reference-guidance) ----------------
# Written with numpy and explicit per-(row, channel) loops, apart from the torch code it checks.


def _apg_np(delta: np.ndarray, along: np.ndarray, eta: float, threshold: float) -> np.ndarray:
    """Per (row, channel): clip g's L2 norm over (T, H, W) to `threshold`, then g_perp + eta * g_par w.r.t. `along`."""
    out = np.empty_like(delta)
    for b in range(delta.shape[0]):
        for c in range(delta.shape[1]):
            g = delta[b, c].ravel()
            if threshold > 0:
                g = g * min(1.0, threshold / np.sqrt(g @ g))
            u = along[b, c].ravel() / max(np.sqrt(along[b, c].ravel() @ along[b, c].ravel()), 1e-12)
            parallel = (g @ u) * u
            out[b, c] = (g - parallel + eta * parallel).reshape(delta.shape[2:])
    return out


def _rescale_np(x: np.ndarray, sigma: float, guided: np.ndarray, cond: np.ndarray, phi: float) -> np.ndarray:
    """RescaleCFG's std matching in ComfyUI's v space; unbiased std over (C, T, H) per (row, column W)."""
    root = np.sqrt(sigma**2 + 1.0)
    x_in = x / (sigma**2 + 1.0)
    v_guided = (x_in - guided) * root / sigma
    v_cond = (x_in - cond) * root / sigma
    out = np.empty_like(x)
    for b in range(x.shape[0]):
        for w in range(x.shape[-1]):
            ratio = v_cond[b, ..., w].std(ddof=1) / v_guided[b, ..., w].std(ddof=1)
            v = phi * v_guided[b, ..., w] * ratio + (1 - phi) * v_guided[b, ..., w]
            out[b, ..., w] = x_in[b, ..., w] - v * sigma / root
    return out


def _expected(x, sigma, dc, du, dn, cfg_scale, ref_guidance, cfg_correction, correction):
    if cfg_correction == "apg":  # ComfyUI's APG node: D_c + s * g' (eta 1, threshold 5, no momentum)
        out = dc + cfg_scale * _apg_np(dc - du, dc, 1.0, 5.0)
    elif cfg_correction == "rescale":  # RescaleCFG 0.7 on the text CFG
        out = _rescale_np(x, sigma, du + cfg_scale * (dc - du), dc, 0.7)
    else:
        out = du + cfg_scale * (dc - du)
    delta = dc - dn
    if correction == "apg":  # the reference delta: orthogonal part only (eta 0), after the norm clip of 5
        delta = _apg_np(delta, dc, 0.0, 5.0)
    out = out + (ref_guidance - 1.0) * delta
    if correction == "rescale":  # phi 0.5, pulling the whole guided estimate's std to D_c,ref's
        out = _rescale_np(x, sigma, out, dc, 0.5)
    return out


@pytest.mark.parametrize("cfg_correction", ["none", "apg", "rescale"])
@pytest.mark.parametrize("correction", ["none", "apg", "rescale"])
def test_reference_guidance_matches_a_float64_rederivation(correction, cfg_correction):
    rng = np.random.default_rng(7)
    shape = (2, 16, 1, 6, 5)
    # Per-channel scales so that the norm clip of 5 acts on some channels and not on others.
    scales = np.linspace(0.1, 3.0, 16).reshape(1, 16, 1, 1, 1)
    x, dc, du, dn = (rng.standard_normal(shape) * scales for _ in range(4))
    dn = dc + 0.8 * (dn - dc)
    sigma = 0.7
    s = RenderSettings(cfg=4.5, ref_guidance=2.5, correction=correction, cfg_correction=cfg_correction)
    plan = step_rows(s, sigma, True)
    assert plan.ref_guidance_active
    x, dc, du, dn = (a.astype(np.float32) for a in (x, dc, du, dn))  # the sampler's dtype
    t = torch.from_numpy
    got = Combiner(s)(t(x), torch.tensor(sigma), plan, {Row.COND: t(dc), Row.UNCOND: t(du), Row.COND_NOREF: t(dn)})
    x64, dc64, du64, dn64 = (a.astype(np.float64) for a in (x, dc, du, dn))
    want = _expected(x64, sigma, dc64, du64, dn64, 4.5, 2.5, cfg_correction, correction)
    assert np.abs(got.double().numpy() - want).max() <= 1e-5 * np.abs(want).max()
    # The clip really acted on part of the channels (so the check covers both branches of min(1, 5/n)).
    norms = np.sqrt(((dc - dn) ** 2).sum(axis=(2, 3, 4)))
    assert (norms > 5).any() and (norms < 5).any()
