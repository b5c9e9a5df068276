"""The identity-gap loss and its statistics (snapref_ray/evaluation.py), on the tiny models without Ray."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from snapref_ray.adapter.images import image_to_pixels
from snapref_ray.evaluation import (
    LOSS_DEFINITION,
    bootstrap_ci,
    denoising_losses,
    derangement,
    encode_target,
    prepare_target,
    summarise,
)
from snapref_ray.models.latent_format import process_in

SIGMAS = [0.2, 0.5, 0.8]
SEEDS = [0, 1, 2]
PROMPT = "1girl, solo, cafe, sitting, smile"

# The overall fields of heldout_loss.json that summarise() produces (docs/evaluate.md).
SUMMARY_FIELDS = {
    "n_cases",
    "n_characters",
    "mean_loss_right",
    "mean_loss_wrong",
    "gap",
    "gap_ci",
    "ci_level",
    "bootstrap",
    "right_wins_fraction",
    "per_sigma",
    "cases",
}
CASE_FIELDS = {"case_id", "character", "mean_loss_right", "mean_loss_wrong", "gap", "right_wins"}


def png_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def target(tiny_models: Path) -> Image.Image:
    return prepare_target((tiny_models / "reference.png").read_bytes(), 1.0, "reference.png")


@pytest.fixture(scope="module")
def refs(tiny_renderer, tiny_models: Path, target):
    """Two different references encoded for the target's size: (own, other)."""
    own = (tiny_models / "reference.png").read_bytes()
    other = png_bytes(np.random.default_rng(5).integers(0, 255, (160, 112, 3), dtype=np.uint8))
    return tuple(
        tiny_renderer.encode_reference(data, width=target.width, height=target.height) for data in (own, other)
    )


# ---------------------------------------------------------------------------------------------
# Losses


def test_losses_have_the_grid_shape_and_are_deterministic(tiny_renderer, target, refs):
    a = denoising_losses(tiny_renderer, target, PROMPT, refs[0], SIGMAS, SEEDS)
    b = denoising_losses(tiny_renderer, target, PROMPT, refs[0], SIGMAS, SEEDS)
    assert a.shape == (3, 3) and a.dtype == torch.float32
    assert torch.isfinite(a).all() and (a > 0).all()
    assert torch.equal(a, b)
    assert len(set(a.flatten().tolist())) == 9  # every σ and seed is its own draw


def test_loss_matches_its_documented_definition(tiny_renderer, target, refs):
    """x_σ = (1-σ)x0 + σε, v = ε - x0, loss = mean((DiT velocity - v)^2), target LoRA on, cond row reads."""
    r = tiny_renderer
    got = denoising_losses(r, target, PROMPT, refs[0], [0.4], [7])
    with torch.inference_mode():
        x0 = process_in(r.vae.encode(image_to_pixels(target)).float()).unsqueeze(2)
        eps = torch.randn(x0.shape[1:], generator=torch.Generator().manual_seed(7)).unsqueeze(0)
        x = 0.6 * x0 + 0.4 * eps
        ctx = r.prompts.encode(PROMPT)
        reads = refs[0].reads(torch.tensor([True]), r.adapter.read_weights("cs", 1.0))
        v_pred = r.dit(x, torch.tensor([0.4]), ctx, loras=r.adapter.target_loras(), refs=reads).float()
        expected = (v_pred - (eps - x0)).square().mean()
    assert got[0, 0].item() == pytest.approx(expected.item(), rel=1e-5)


def test_without_reference_the_plain_model_runs(tiny_renderer, target):
    r = tiny_renderer
    got = denoising_losses(r, target, PROMPT, None, [0.6], [3])
    with torch.inference_mode():
        x0 = encode_target(r, target)
        eps = torch.randn(x0.shape[1:], generator=torch.Generator().manual_seed(3)).unsqueeze(0)
        x = 0.4 * x0 + 0.6 * eps
        v_pred = r.dit(x, torch.tensor([0.6]), r.prompts.encode(PROMPT)).float()
        expected = (v_pred - (eps - x0)).square().mean()
    assert got[0, 0].item() == pytest.approx(expected.item(), rel=1e-5)


def test_noise_depends_on_the_seed_only_and_is_shared_across_batching(tiny_renderer, target, refs):
    together = denoising_losses(tiny_renderer, target, PROMPT, refs[0], SIGMAS, SEEDS)
    one_by_one = denoising_losses(tiny_renderer, target, PROMPT, refs[0], SIGMAS, SEEDS, batch_size=1)
    alone = denoising_losses(tiny_renderer, target, PROMPT, refs[0], SIGMAS, [SEEDS[2]])
    torch.testing.assert_close(one_by_one, together, rtol=1e-5, atol=0)
    torch.testing.assert_close(alone[:, 0], together[:, 2], rtol=1e-5, atol=0)


def test_the_reference_changes_the_loss(tiny_renderer, target, refs):
    right = denoising_losses(tiny_renderer, target, PROMPT, refs[0], SIGMAS, SEEDS)
    wrong = denoising_losses(tiny_renderer, target, PROMPT, refs[1], SIGMAS, SEEDS)
    plain = denoising_losses(tiny_renderer, target, PROMPT, None, SIGMAS, SEEDS)
    assert not torch.equal(right, wrong) and not torch.equal(right, plain)
    # ref_weight 0 reads nothing, but the target LoRA stays on: different from the plain model
    off = denoising_losses(tiny_renderer, target, PROMPT, refs[0], SIGMAS, SEEDS, ref_weight=0.0)
    off_other = denoising_losses(tiny_renderer, target, PROMPT, refs[1], SIGMAS, SEEDS, ref_weight=0.0)
    assert torch.equal(off, off_other)


def test_refkv_for_another_size_is_refused(tiny_renderer, tiny_models, target):
    kv = tiny_renderer.encode_reference((tiny_models / "reference.png").read_bytes(), width=256, height=256)
    with pytest.raises(ValueError, match=r"encoded for a \(1, 16, 16\) token grid; the 128x192 target needs"):
        denoising_losses(tiny_renderer, target, PROMPT, kv, SIGMAS, SEEDS)


def test_bad_sigmas_are_refused(tiny_renderer, target):
    with pytest.raises(ValueError, match=r"sigmas must lie in \(0, 1\], found \[0.0\]"):
        denoising_losses(tiny_renderer, target, PROMPT, None, [0.0, 0.5], SEEDS)


def test_targets_are_fitted_to_multiples_of_16():
    img = prepare_target(png_bytes(np.zeros((100, 70, 3), np.uint8)), 1.0)
    assert img.size == (64, 96)


# ---------------------------------------------------------------------------------------------
# Derangement


@pytest.mark.parametrize("n", [2, 3, 5, 17, 40])
def test_derangement_has_no_fixed_points_and_is_seeded(n):
    for seed in range(20):
        p = derangement(n, seed)
        assert sorted(p) == list(range(n))
        assert all(p[i] != i for i in range(n))
        assert p == derangement(n, seed)
    # n = 2 and 3 have 1 and 2 derangements; larger n get mostly different ones from different seeds
    distinct = len({tuple(derangement(n, seed)) for seed in range(20)})
    assert distinct == {2: 1, 3: 2}[n] if n <= 3 else distinct >= 12


@pytest.mark.parametrize(
    "groups",
    [
        ["a", "a", "b", "b", "c", "c"],
        ["a", "a", "a", "b", "c", "c", "d"],
        ["x"] * 10 + ["y"] * 10,  # only the exact swaps qualify: the constructive fallback runs
        ["x"] * 5 + ["y"] * 3 + ["z"] * 2,
    ],
)
def test_derangement_never_gives_a_character_its_own_reference(groups):
    for seed in range(25):
        p = derangement(len(groups), seed, groups)
        assert sorted(p) == list(range(len(groups)))
        assert all(groups[p[i]] != groups[i] for i in range(len(groups))), (seed, p)
        assert p == derangement(len(groups), seed, groups)


def test_derangement_refuses_impossible_inputs():
    with pytest.raises(ValueError, match="'a' has 3 of 5 cases"):
        derangement(5, 0, ["a", "a", "a", "b", "c"])
    with pytest.raises(ValueError, match="at least 2 cases, got 1"):
        derangement(1, 0)
    with pytest.raises(ValueError, match="3 group labels for 4 cases"):
        derangement(4, 0, ["a", "b", "c"])


# ---------------------------------------------------------------------------------------------
# Bootstrap and summary


def test_bootstrap_ci_contains_the_mean_and_is_deterministic():
    values = np.random.default_rng(0).normal(0.004, 0.01, size=40)
    lo, hi = bootstrap_ci(values, seed=3)
    assert lo < values.mean() < hi
    assert (lo, hi) == bootstrap_ci(values, seed=3)
    assert (lo, hi) != bootstrap_ci(values, seed=4)
    narrow = bootstrap_ci(values, seed=3, level=0.5)
    assert lo < narrow[0] < values.mean() < narrow[1] < hi


def test_bootstrap_ci_flips_exactly_under_negation_also_by_group():
    values = np.random.default_rng(1).normal(0.0, 1.0, size=25)
    groups = [i // 3 for i in range(25)]
    for g in (None, groups):
        lo, hi = bootstrap_ci(values, seed=9, groups=g)
        assert bootstrap_ci(-values, seed=9, groups=g) == (-hi, -lo)


def test_bootstrap_by_group_resamples_whole_groups():
    # Two groups with constant values: any resample's mean is a weighted mix of 1 and 3 by group size.
    values = [1.0, 1.0, 3.0, 3.0]
    lo, hi = bootstrap_ci(values, seed=0, n_boot=500, groups=["a", "a", "b", "b"])
    assert (lo, hi) == (1.0, 3.0)
    assert bootstrap_ci([2.5], seed=0) == (2.5, 2.5)


def cases_fixture(rng: np.random.Generator, n: int = 8) -> list[dict]:
    return [
        {
            "case_id": f"c{i}",
            "character": f"ch{i // 2}",
            "prompt": f"scene {i}",
            "loss_right": rng.uniform(0.5, 1.0, size=(3, 4)),
            "loss_wrong": rng.uniform(0.5, 1.05, size=(3, 4)),
        }
        for i in range(n)
    ]


def test_swapping_right_and_wrong_flips_the_sign_of_the_gap_exactly():
    cases = cases_fixture(np.random.default_rng(2))
    swapped = [{**c, "loss_right": c["loss_wrong"], "loss_wrong": c["loss_right"]} for c in cases]
    a, b = summarise(cases, sigmas=SIGMAS), summarise(swapped, sigmas=SIGMAS)
    assert b["gap"] == -a["gap"] and a["gap"] != 0.0
    assert b["gap_ci"] == [-a["gap_ci"][1], -a["gap_ci"][0]]
    assert [c["gap"] for c in b["cases"]] == [-c["gap"] for c in a["cases"]]
    assert [s["gap"] for s in b["per_sigma"]] == [-s["gap"] for s in a["per_sigma"]]
    assert (b["mean_loss_right"], b["mean_loss_wrong"]) == (a["mean_loss_wrong"], a["mean_loss_right"])
    assert a["right_wins_fraction"] + b["right_wins_fraction"] == 1.0  # no ties among random floats


def test_summary_fields_and_numbers():
    cases = cases_fixture(np.random.default_rng(4))
    s = summarise(cases, sigmas=SIGMAS, seed=1, n_boot=500, level=0.9)
    assert SUMMARY_FIELDS <= set(s)
    assert s["n_cases"] == 8 and s["n_characters"] == 4 and s["ci_level"] == 0.9
    assert s["bootstrap"] == {"n_boot": 500, "seed": 1, "unit": "character", "method": "percentile"}
    for case, src in zip(s["cases"], cases):
        assert CASE_FIELDS <= set(case) and case["prompt"] == src["prompt"]
        assert case["gap"] == float(src["loss_wrong"].mean()) - float(src["loss_right"].mean())
        assert case["right_wins"] == (case["gap"] > 0)
    gaps = [c["gap"] for c in s["cases"]]
    assert s["gap"] == pytest.approx(np.mean(gaps), abs=0)
    assert s["gap"] == pytest.approx(s["mean_loss_wrong"] - s["mean_loss_right"], abs=1e-12)
    assert s["gap_ci"] == list(bootstrap_ci(gaps, 1, 500, 0.9, groups=[c["character"] for c in cases]))
    assert s["right_wins_fraction"] == sum(g > 0 for g in gaps) / 8
    assert [p["sigma"] for p in s["per_sigma"]] == SIGMAS
    expected_sigma0 = np.mean([c["loss_wrong"][0].mean() - c["loss_right"][0].mean() for c in cases])
    assert s["per_sigma"][0]["gap"] == pytest.approx(expected_sigma0, rel=1e-12)
    json.dumps(s)  # everything in it is plain JSON
    assert "eps" in LOSS_DEFINITION and "no CFG" in LOSS_DEFINITION


def test_summary_refuses_mismatched_grids():
    cases = cases_fixture(np.random.default_rng(5), 2)
    cases[1]["loss_wrong"] = np.ones((2, 4))
    with pytest.raises(ValueError, match=r"case c1: loss grids of shape \(3, 4\) and \(2, 4\)"):
        summarise(cases)
