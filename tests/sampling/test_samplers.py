"""euler and er_sde against float64 re-derivations written here from docs/design.md#samplers."""

import math

import pytest
import torch

from snapref_ray.sampling.noise import initial_noise, noise_scaling
from snapref_ray.sampling.samplers import SAMPLERS, sample, sample_er_sde, sample_euler
from snapref_ray.sampling.schedules import get_sigmas

ROW_SHAPE = (4, 1, 3, 5)  # [C, T, H, W], a tiny latent
FIRST_SIGMA_ER_SDE = 0.99996668  # percent_to_sigma(1e-4) at shift 3, as float32


class Recorder:
    """D(x, σ) = c·x + k·σ, elementwise (so rows are independent); remembers the σ of each call."""

    def __init__(self, c: float = 0.6, k: float = 0.25) -> None:
        self.c, self.k, self.sigmas = c, k, []

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        assert sigma.ndim == 0 and sigma.dtype == torch.float32
        self.sigmas.append(sigma.item())
        return self.c * x + self.k * sigma


def start(seeds=(5,)) -> torch.Tensor:
    return initial_noise(list(seeds), ROW_SHAPE, "cpu")


# ---- float64 references ---------------------------------------------------------------------------
def euler_reference(x, sigmas, c, k):
    x = x.double()
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        d = (x - (c * x + k * s)) / s
        x = x + d * (s_next - s)
    return x


# ---- ComfyUI's noise, constructed as ComfyUI does it (comfy/sample.py, comfy/k_diffusion/sampling.py) ----------
def comfyui_prepare_noise(seed: int, shape_BCTHW) -> torch.Tensor:
    """`prepare_noise`: the GLOBAL CPU generator seeded with torch.manual_seed, one randn of the whole batch."""
    saved = torch.get_rng_state()
    try:
        generator = torch.manual_seed(seed)
        return torch.randn(shape_BCTHW, dtype=torch.float32, layout=torch.strided, generator=generator, device="cpu")
    finally:
        torch.set_rng_state(saved)


def comfyui_noise_sampler(x: torch.Tensor, seed: int):
    """`default_noise_sampler(x, seed)`: a generator on x's device, seed + 1 on the CPU, randn(x.size()) per call."""
    if x.device == torch.device("cpu"):
        seed += 1
    generator = torch.Generator(device=x.device)
    generator.manual_seed(seed)
    return lambda: torch.randn(x.size(), dtype=torch.float32, layout=x.layout, device=x.device, generator=generator)


def er_sde_reference(x, sigmas, c, k, seeds):
    """ER-SDE-3 step by step in float64: λ = σ/(1−σ), α = 1−σ, ns(λ) = λ(e^{λ^0.3} + 10)."""
    sig = list(sigmas)
    if sig[0] >= 1:
        sig[0] = FIRST_SIGMA_ER_SDE
    lam = [s / (1 - s) for s in sig]
    alpha = [1 - s for s in sig]

    def ns(v):
        return v * (math.exp(v**0.3) + 10)

    if isinstance(seeds, int):  # ComfyUI: one generator, one randn of the whole batch per step
        draw_noise = comfyui_noise_sampler(x, seeds)
    else:  # one generator per row, CPU: seed + 1
        generators = [torch.Generator().manual_seed(s + 1) for s in seeds]
        draw_noise = lambda: torch.stack([torch.randn(ROW_SHAPE, generator=g) for g in generators])  # noqa: E731
    x = x.double()
    prev_d = prev_dd = None
    for i in range(len(sig) - 1):
        d = c * x + k * sig[i]
        if sig[i + 1] == 0:
            x = d
            continue
        r = ns(lam[i + 1]) / ns(lam[i])
        x = alpha[i + 1] / alpha[i] * r * x + alpha[i + 1] * (1 - r) * d
        if i >= 1:
            delta = lam[i + 1] - lam[i]
            h = -delta / 200
            points = [lam[i + 1] + j * h for j in range(200)]
            s1 = h * sum(1 / ns(p) for p in points)
            dd = (d - prev_d) / (lam[i] - lam[i - 1])
            x = x + alpha[i + 1] * (delta + s1 * ns(lam[i + 1])) * dd
            if i >= 2:
                s2 = h * sum((p - lam[i]) / ns(p) for p in points)
                ddd = (dd - prev_dd) / ((lam[i] - lam[i - 2]) / 2)
                x = x + alpha[i + 1] * (delta**2 / 2 + s2 * ns(lam[i + 1])) * ddd
            prev_dd = dd
        var = lam[i + 1] ** 2 - lam[i] ** 2 * r**2
        eps = draw_noise().double()
        x = x + alpha[i + 1] * eps * (math.sqrt(var) if var > 0 else 0.0)
        prev_d = d
    return x


# ---- euler ------------------------------------------------------------------------------------------
def test_euler_matches_closed_form():
    # With D = c·x, each step multiplies x by 1 + (1−c)(σ_{i+1}−σ_i)/σ_i.
    sigmas = get_sigmas("simple", 12)
    x0 = start()
    out = sample_euler(Recorder(c=0.6, k=0.0), x0, sigmas)
    s = sigmas.double().tolist()
    factor = math.prod(1 + 0.4 * (b - a) / a for a, b in zip(s[:-1], s[1:]))
    assert torch.allclose(out.double(), x0.double() * factor, rtol=1e-5, atol=1e-7)


def test_euler_matches_reference_and_calls_each_sigma():
    sigmas = get_sigmas("simple", 10)
    denoiser = Recorder()
    out = sample(denoiser, start(), sigmas, "euler", callback=None)
    ref = euler_reference(start(), sigmas.double().tolist(), denoiser.c, denoiser.k)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)
    assert denoiser.sigmas == pytest.approx(sigmas[:-1].tolist(), abs=0)


# ---- er_sde -----------------------------------------------------------------------------------------
def test_er_sde_matches_reference():
    sigmas = get_sigmas("simple", 8)
    denoiser = Recorder()
    out = sample(denoiser, start(), sigmas, "er_sde", seed=1234)
    ref = er_sde_reference(start(), sigmas.double().tolist(), denoiser.c, denoiser.k, [1234])
    assert out.abs().max() > 0.1
    assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-5), (out.double() - ref).abs().max()


def test_er_sde_first_model_call_uses_offset_sigma():
    sigmas = get_sigmas("simple", 6)
    denoiser = Recorder()
    sample_er_sde(denoiser, start(), sigmas, seed=0)
    assert denoiser.sigmas[0] == torch.tensor(FIRST_SIGMA_ER_SDE, dtype=torch.float32).item()
    assert denoiser.sigmas[1:] == sigmas[1:-1].tolist()
    assert sigmas[0].item() == 1.0  # the caller's schedule is not modified


def test_er_sde_keeps_first_sigma_below_one():
    sigmas = get_sigmas("simple", 6, denoise=0.5)
    denoiser = Recorder()
    out = sample_er_sde(denoiser, start(), sigmas, seed=9)
    assert denoiser.sigmas == sigmas[:-1].tolist()
    ref = er_sde_reference(start(), sigmas.double().tolist(), denoiser.c, denoiser.k, [9])
    assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_er_sde_is_deterministic_and_seed_dependent():
    sigmas = get_sigmas("simple", 6)
    a = sample_er_sde(Recorder(), start(), sigmas, seed=42)
    b = sample_er_sde(Recorder(), start(), sigmas, seed=42)
    c = sample_er_sde(Recorder(), start(), sigmas, seed=43)
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 1e-3


def test_er_sde_per_row_seeds_equal_separate_runs():
    sigmas = get_sigmas("simple", 7)
    seeds = [3, 7, 11]
    batch = sample_er_sde(Recorder(), start(seeds), sigmas, seed=seeds)
    for b, s in enumerate(seeds):
        alone = sample_er_sde(Recorder(), start([s]), sigmas, seed=s)
        assert torch.equal(batch[b : b + 1], alone)
    ref = er_sde_reference(start(seeds), sigmas.double().tolist(), 0.6, 0.25, seeds)
    assert torch.allclose(batch.double(), ref, rtol=1e-4, atol=1e-5)


def test_one_int_seed_draws_the_initial_batch_noise_like_comfyui():
    shape = (3, *ROW_SHAPE)
    noise = initial_noise(8, ROW_SHAPE, batch=3)
    assert torch.equal(noise, comfyui_prepare_noise(8, shape))
    assert not torch.equal(noise[0], noise[1])  # rows of one ComfyUI batch differ
    assert torch.equal(initial_noise(8, ROW_SHAPE), initial_noise([8], ROW_SHAPE))  # one row: both forms agree


def test_er_sde_one_int_seed_draws_the_batch_from_one_generator_like_comfyui():
    sigmas = get_sigmas("simple", 5)
    x = comfyui_prepare_noise(8, (3, *ROW_SHAPE))
    out = sample_er_sde(Recorder(), x, sigmas, seed=8)
    ref = er_sde_reference(x, sigmas.double().tolist(), 0.6, 0.25, 8)
    assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-5), (out.double() - ref).abs().max()
    # Not the per-row streams: a list of the same seed draws every row from its own copy of one stream.
    per_row = sample_er_sde(Recorder(), x, sigmas, seed=[8, 8, 8])
    assert not torch.allclose(out, per_row)


def test_er_sde_seed_count_must_match_batch():
    with pytest.raises(ValueError, match="got 2 seeds for a batch of 3 rows"):
        sample_er_sde(Recorder(), start([1, 2, 3]), get_sigmas("simple", 4), seed=[1, 2])


# ---- dispatch and callback --------------------------------------------------------------------------
@pytest.mark.parametrize("sampler", ["euler", "er_sde"])
def test_callback_after_each_step(sampler):
    calls = []
    sample(Recorder(), start(), get_sigmas("simple", 5), sampler, seed=0, callback=lambda i, n: calls.append((i, n)))
    assert calls == [(i, 5) for i in range(5)]


def test_unknown_sampler_names_known_ones():
    with pytest.raises(ValueError, match=r"unknown sampler 'dpmpp_2m'; known samplers: euler, er_sde"):
        sample(Recorder(), start(), get_sigmas("simple", 4), "dpmpp_2m")


# ---- initial noise ----------------------------------------------------------------------------------
def test_initial_noise_one_row_equals_comfyui_prepare_noise():
    with torch.random.fork_rng():
        generator = torch.manual_seed(123456)  # ComfyUI: the global CPU generator, one randn of the batch
        expected = torch.randn([1, *ROW_SHAPE], dtype=torch.float32, generator=generator, device="cpu")
    noise = initial_noise([123456], ROW_SHAPE, "cpu")
    assert noise.dtype == torch.float32 and noise.shape == (1, *ROW_SHAPE)
    assert torch.equal(noise, expected)


def test_initial_noise_rows_do_not_depend_on_batch():
    batch = initial_noise([1, 2, 3], (16, 4, 4), "cpu")
    assert batch.shape == (3, 16, 4, 4)
    for b, s in enumerate([1, 2, 3]):
        assert torch.equal(batch[b], initial_noise([s], (16, 4, 4), "cpu")[0])
    assert not torch.equal(batch[0], batch[1])


def test_noise_scaling():
    noise, latent = torch.full((1, 2), 2.0), torch.full((1, 2), -1.0)
    assert torch.equal(noise_scaling(1.0, noise, latent), noise)
    assert torch.allclose(noise_scaling(torch.tensor(0.25), noise, latent), torch.full((1, 2), 0.25 * 2 - 0.75))
    per_row = noise_scaling(torch.tensor([1.0, 0.0]), torch.ones(2, 3), torch.zeros(2, 3))
    assert per_row.tolist() == [[1.0] * 3, [0.0] * 3]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_samplers_never_read_the_latent_back(sampler):
    """On the meta device any host read (`.item()`, `bool(t)`, a branch on σ kept beside the latent)
    raises, so a loop over a meta latent proves every read is of the host schedule (CPU stand-in for
    a GPU sync check). er_sde runs with s_noise 0: meta tensors have no generator."""
    x = torch.empty(2, 16, 1, 8, 8, device="meta")
    seen: list[torch.Tensor] = []

    def denoise(x_B, sigma):
        seen.append(sigma)
        return x_B * 0.5

    sigmas = get_sigmas("simple", 5)
    out = sample_euler(denoise, x, sigmas) if sampler == "euler" else sample_er_sde(denoise, x, sigmas, s_noise=0.0)
    assert out.device.type == "meta" and out.shape == x.shape
    assert len(seen) == 5 and all(s.device.type == "cpu" and s.ndim == 0 for s in seen)
