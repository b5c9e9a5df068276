import pytest
import torch

from snapref_ray.sampling.guidance import APG, apg_project, cfg, rescale_cfg

SHAPE = (2, 3, 1, 4, 5)  # [B, C, T, H, W]


def rand(seed: int, shape=SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def case():
    return rand(0), rand(1), rand(2)  # x, D_c, D_u


def test_cfg_formula():
    assert cfg(torch.tensor([3.0]), torch.tensor([1.0]), 4.0).item() == 9.0
    assert cfg(torch.tensor([3.0]), torch.tensor([1.0]), 1.0).item() == 3.0


def test_rescale_cfg_multiplier_zero_is_cfg(case):
    x, d_c, d_u = case
    for sigma in (0.9, torch.tensor(0.3), torch.tensor([0.5, 0.5])):
        out = rescale_cfg(x, sigma, d_c, d_u, 4.0, multiplier=0.0)
        assert torch.allclose(out, cfg(d_c, d_u, 4.0), atol=1e-5)


def rescale_reference(x, sigma, d_c, d_u, s, phi):
    """RescaleCFG (docs/design.md#guidance-cfg-rescalecfg-apg) in float64, explicit loops over (row, column W)."""
    x, d_c, d_u = x.double(), d_c.double(), d_u.double()
    x_in = x / (sigma**2 + 1)
    c = (x_in - d_c) * (sigma**2 + 1) ** 0.5 / sigma
    u = (x_in - d_u) * (sigma**2 + 1) ** 0.5 / sigma
    g = u + s * (c - u)
    g_r = torch.empty_like(g)
    for b in range(g.shape[0]):
        for w in range(g.shape[-1]):
            g_r[b, ..., w] = g[b, ..., w] * c[b, ..., w].std() / g[b, ..., w].std()  # unbiased over (C, T, H)
    g_f = phi * g_r + (1 - phi) * g
    return x_in - g_f * sigma / (sigma**2 + 1) ** 0.5


def test_rescale_cfg_matches_reference(case):
    x, d_c, d_u = case
    out = rescale_cfg(x, torch.tensor(0.8), d_c, d_u, 5.0, multiplier=0.7)
    ref = rescale_reference(x, 0.8, d_c, d_u, 5.0, 0.7)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert (out - cfg(d_c, d_u, 5.0)).abs().max() > 1e-2  # the rescale does something


def test_apg_eta_one_without_threshold_is_cfg_with_scale_plus_one(case):
    _, d_c, d_u = case
    apg = APG(eta=1.0, norm_threshold=0.0, momentum=0.0)
    out = apg(d_c, d_u, torch.tensor(0.7), 4.0)
    assert torch.allclose(out, cfg(d_c, d_u, 5.0), atol=1e-5)


def apg_reference(d_c, d_u, s, eta, threshold):
    """APG (docs/design.md#guidance-cfg-rescalecfg-apg) in float64, one (row, channel) at a time."""
    d_c, d_u = d_c.double(), d_u.double()
    out = torch.empty_like(d_c)
    for b in range(d_c.shape[0]):
        for ch in range(d_c.shape[1]):
            g = d_c[b, ch] - d_u[b, ch]
            if threshold > 0:
                g = g * min(1.0, threshold / g.norm().item())
            unit = d_c[b, ch] / d_c[b, ch].norm()
            par = (g * unit).sum() * unit
            out[b, ch] = d_c[b, ch] + s * ((g - par) + eta * par)
    return out


@pytest.mark.parametrize("eta, threshold", [(1.0, 5.0), (0.0, 0.0), (0.3, 2.0)])
def test_apg_matches_reference(case, eta, threshold):
    _, d_c, d_u = case
    d_u = d_u * 3  # big enough deltas that a threshold of 2 or 5 clips some channels
    out = APG(eta=eta, norm_threshold=threshold)(d_c, d_u, 0.5, 4.0)
    assert torch.allclose(out.double(), apg_reference(d_c, d_u, 4.0, eta, threshold), atol=1e-5)


def test_apg_threshold_clips_per_channel():
    d_c = rand(5)
    delta = torch.zeros(SHAPE)
    delta[:, 0] = 10.0  # channel 0: norm 10·√20, clipped to 5; others unchanged (zero)
    g = apg_project(delta, d_c, eta=1.0, norm_threshold=5.0)
    norms = torch.linalg.vector_norm(g, dim=(-1, -2, -3))
    assert torch.allclose(norms[:, 0], torch.full((2,), 5.0))
    assert torch.equal(norms[:, 1:], torch.zeros(2, 2))


def test_apg_project_splits_parallel_and_orthogonal():
    ref = torch.zeros(1, 1, 1, 1, 2)
    ref[..., 0] = 2.0
    delta = torch.tensor([3.0, 4.0]).reshape(1, 1, 1, 1, 2)
    assert apg_project(delta, ref, eta=0.0, norm_threshold=0.0).flatten().tolist() == [0.0, 4.0]
    assert apg_project(delta, ref, eta=0.5, norm_threshold=0.0).flatten().tolist() == [1.5, 4.0]


def test_apg_momentum_running_average_and_reset():
    d_c = rand(10)
    g1, g2, g3 = rand(11), rand(12), rand(13)
    apg = APG(eta=1.0, norm_threshold=0.0, momentum=0.5)
    # With eta = 1 and no threshold the returned D is D_c + s·(running average).
    out1 = apg(d_c, d_c - g1, torch.tensor(0.9), 2.0)
    assert torch.allclose(out1, d_c + 2.0 * g1, atol=1e-5)
    out2 = apg(d_c, d_c - g2, torch.tensor(0.5), 2.0)
    assert torch.allclose(out2, d_c + 2.0 * (0.5 * g1 + g2), atol=1e-5)
    out3 = apg(d_c, d_c - g3, torch.tensor(1.0), 2.0)  # σ rose: a new run, the average restarts
    assert torch.allclose(out3, d_c + 2.0 * g3, atol=1e-5)
