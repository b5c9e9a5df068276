import pytest
import torch

from snapref_ray.sampling.schedules import flow_sigma_table, get_sigmas, percent_to_sigma

# docs/design.md#flow-matching-and-the-sigma-schedule: ComfyUI's "simple" schedule for 30 steps.
SIMPLE_30 = [
    1.0,
    0.988753,
    0.976987,
    0.964286,
    0.951353,
    0.937781,
    0.923077,
    0.908051,
    0.89222,
    0.875,
    0.857326,
    0.838624,
    0.818182,
    0.797095,
    0.774662,
    0.75,
    0.724405,
    0.697002,
    0.666667,
    0.634948,
    0.600719,
    0.5625,
    0.522164,
    0.478202,
    0.428571,
    0.375562,
    0.317035,
    0.25,
    0.177249,
    0.095506,
    0.0,
]


def shift3(t: float) -> float:
    return 3 * t / (1 + 2 * t)


def test_sigma_table_ends_and_values():
    table = flow_sigma_table()
    assert table.dtype == torch.float32 and table.shape == (1000,)
    assert table[0].item() == pytest.approx(0.0029940, abs=1e-7)  # σ_min = shift3(0.001)
    assert table[999].item() == 1.0  # σ_max
    assert table[499].item() == pytest.approx(0.75, abs=1e-7)  # shift3(0.5)
    assert bool((table[1:] > table[:-1]).all())


def test_sigma_table_other_shift():
    table = flow_sigma_table(shift=1.0)
    assert table[0].item() == pytest.approx(0.001) and table[999].item() == 1.0


def test_simple_30_steps_matches_spec():
    sigmas = get_sigmas("simple", 30)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (31,)
    assert torch.allclose(sigmas, torch.tensor(SIMPLE_30), atol=1e-6, rtol=0)
    assert sigmas[-1].item() == 0.0


def test_simple_keeps_comfyui_float_index_arithmetic():
    # int(19 * (1000/38)) is 499 in double precision, not floor(19000/38) = 500.
    table = flow_sigma_table()
    assert get_sigmas("simple", 38)[19].item() == table[999 - 499].item()


def test_denoise_half_keeps_tail_of_longer_schedule():
    full = get_sigmas("simple", 20)
    half = get_sigmas("simple", 10, denoise=0.5)
    assert half.shape == (11,)
    assert torch.equal(half, full[-11:])
    assert half[0].item() == pytest.approx(shift3(0.5), abs=1e-6)  # starts half-way: σ = 0.75


def test_denoise_near_one_is_full_schedule():
    assert torch.equal(get_sigmas("simple", 30, denoise=0.99995), get_sigmas("simple", 30))


def test_percent_to_sigma():
    assert percent_to_sigma(0.0) == 1.0
    assert percent_to_sigma(-0.5) == 1.0
    assert percent_to_sigma(1.0) == 0.0
    assert percent_to_sigma(0.5) == pytest.approx(0.75)
    assert percent_to_sigma(1e-4) == pytest.approx(0.99996667, abs=1e-8)
    assert torch.tensor(percent_to_sigma(1e-4), dtype=torch.float32).item() == pytest.approx(0.99996668, abs=1e-8)


def test_unknown_scheduler_names_known_ones():
    with pytest.raises(ValueError, match=r"unknown scheduler 'karras'; known schedulers: simple"):
        get_sigmas("karras", 30)


@pytest.mark.parametrize("steps, denoise", [(0, 1.0), (10, 0.0), (10, 1.5)])
def test_bad_steps_or_denoise(steps, denoise):
    with pytest.raises(ValueError):
        get_sigmas("simple", steps, denoise=denoise)
