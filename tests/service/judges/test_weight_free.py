"""The checks that need no weights (render_service/judges/sanity.py, near_duplicate.py) and the JudgeSpec,
each against numbers computed apart: `imagehash` itself for the distances, numpy on images built on purpose."""

from __future__ import annotations

import imagehash
import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from snapref_ray.render_service.judges.near_duplicate import (
    near_duplicate_passes,
    nearest_distance,
    parse_phash,
    phash,
    score_near_duplicate,
)
from snapref_ray.render_service.judges.sanity import sanity_passes, score_sanity
from snapref_ray.render_service.judges.scores import JUDGEMENT_COLUMNS, Judgement, JudgeScores, judgement_columns
from snapref_ray.render_service.judges.spec import JudgeSpec, NearDuplicateCheck, SanityCheck


def _noise(seed: int, size=(96, 64)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def _gradient(shift: int) -> Image.Image:
    y, x = np.mgrid[0:128, 0:96]
    rgb = np.stack([(x * 2 + shift) % 256, (y * 2) % 256, ((x + y + shift) * 3) % 256], axis=-1).astype(np.uint8)
    return Image.fromarray(rgb)


# -- near-duplicates ---------------------------------------------------------------------------


def test_the_distance_is_imagehash_own_hamming_distance_to_the_nearest_kept_image():
    kept_images = [_noise(1), _gradient(0), _noise(2)]
    candidates = [_gradient(3), _noise(1), _noise(9)]  # near one kept image, equal to one, unlike all
    kept = [phash(image) for image in kept_images]
    scored = score_near_duplicate(candidates, kept)
    for image, got in zip(candidates, scored):
        oracle = imagehash.phash(image)
        assert got["phash"] == str(oracle)
        assert got["near_duplicate"] == min(oracle - imagehash.phash(k) for k in kept_images)
    assert scored[1]["near_duplicate"] == 0
    assert 0 < scored[0]["near_duplicate"] < scored[2]["near_duplicate"]


def test_no_kept_image_is_64_and_a_large_kept_set_gives_the_same_nearest():
    value = phash(_noise(4))
    assert nearest_distance(value, []) == 64
    assert score_near_duplicate([_noise(4)], [])[0]["near_duplicate"] == 64
    rng = np.random.default_rng(0)
    kept = [int(v) for v in rng.integers(0, 2**63, 200, dtype=np.int64)] + [value ^ 0b1011]  # 3 bits apart
    assert nearest_distance(value, kept) == 3  # the vectorised path (> 32 hashes)
    assert nearest_distance(value, kept[-20:]) == min(bin(value ^ k).count("1") for k in kept[-20:])


def test_rejected_at_or_below_max_distance():
    check = NearDuplicateCheck(max_distance=6)
    assert not near_duplicate_passes({"near_duplicate": 6}, check)
    assert near_duplicate_passes({"near_duplicate": 7}, check)
    assert near_duplicate_passes({"near_duplicate": 0}, NearDuplicateCheck(max_distance=-1))


def test_a_phash_is_16_hex_digits():
    assert parse_phash("ffffffffffffffff") == 2**64 - 1
    with pytest.raises(ValueError, match="16 hex digits"):
        parse_phash("not-a-hash")
    with pytest.raises(ValueError, match="64 bits"):
        parse_phash("1" + "0" * 16)


# -- sanity ------------------------------------------------------------------------------------


def _oracle(image: Image.Image) -> dict:
    a = np.asarray(image.convert("RGB")).astype(np.float64)
    return {
        "sanity_std": max(a[..., c].std() for c in range(3)),
        "sanity_luminance": (0.299 * a[..., 0] + 0.587 * a[..., 1] + 0.114 * a[..., 2]).mean(),
        "sanity_clipped": np.mean((a == 0) | (a == 255)),
    }


def test_sanity_scores_match_numpy_on_images_built_on_purpose():
    flat = Image.new("RGB", (80, 64), (120, 130, 140))
    dark = Image.fromarray(np.random.default_rng(3).integers(0, 6, (64, 80, 3), dtype=np.uint8))
    clipped = Image.fromarray(np.where(np.random.default_rng(4).random((64, 80, 3)) < 0.5, 0, 255).astype(np.uint8))
    scene = _gradient(5)
    images = [flat, dark, clipped, scene]
    scored = score_sanity(images, [0.0, 0.0, 0.0, 0.25])
    for image, got in zip(images, scored):
        for name, value in _oracle(image).items():
            assert got[name] == pytest.approx(value, abs=1e-9), name
    assert [s["sanity_nonfinite"] for s in scored] == [0.0, 0.0, 0.0, 0.25]

    check = SanityCheck()
    verdicts = [sanity_passes(s, check) for s in scored]
    # Flat: std 0; dark: mean luminance ~2.5; clipped: every value at 0 or 255; the scene: NaN in its latent.
    assert verdicts == [False, False, False, False]
    assert scored[0]["sanity_std"] == 0.0 and scored[1]["sanity_luminance"] < check.min_mean_luminance
    assert scored[2]["sanity_clipped"] == 1.0 and scored[2]["sanity_std"] > 100
    assert sanity_passes({**scored[3], "sanity_nonfinite": 0.0}, check)


# -- the spec and the record -------------------------------------------------------------------


def test_a_spec_names_its_checks_with_documented_defaults():
    spec = JudgeSpec.model_validate({"near_duplicate": {}, "sanity": {"min_mean_luminance": 20}})
    assert spec.checks == ("sanity", "near_duplicate")
    assert spec.near_duplicate.max_distance == 6 and spec.sanity.min_mean_luminance == 20
    assert JudgeSpec.of_names("sanity, near_duplicate") == JudgeSpec(sanity=SanityCheck(), near_duplicate={})
    with pytest.raises(ValueError, match="unknown check 'sanitty'"):
        JudgeSpec.of_names("sanitty")
    with pytest.raises(ValidationError, match="max_distnace"):
        JudgeSpec.model_validate({"near_duplicate": {"max_distnace": 3}})
    with pytest.raises(ValidationError, match=r"sigmas must lie in \(0, 1\]"):
        JudgeSpec.model_validate({"identity_gap": {"sigmas": [0.0, 0.5]}})


def test_judgement_columns_name_every_score():
    judgement = Judgement.of(JudgeScores(near_duplicate=3, phash="00000000000000ff"), {"near_duplicate": False})
    row = judgement_columns(judgement)
    assert list(row) == list(JUDGEMENT_COLUMNS)
    assert (row["score_near_duplicate"], row["phash"], row["accepted"]) == (3, "00000000000000ff", False)
    assert row["score_sanity_std"] is None and judgement.rejected_by == ("near_duplicate",)
    assert set(judgement_columns(None).values()) == {None}
