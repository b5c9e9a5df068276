"""The render service judges a batch right after its decode (render_service/service.py, judges/registry.py), on
the tiny models, each check against a computation made apart from it: the latent's non-finite fraction against
the latent the sampler returned, the identity gap against snapref_ray/evaluation.py's own losses for the same
image and references, the embedding against a direct `transformers` computation with a tiny random-weight
CLIP and DINOv2 saved in the real layout."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from snapref_ray.evaluation import denoising_losses
from snapref_ray.render_service.judges.call import JudgeCall
from snapref_ray.render_service.judges.near_duplicate import nearest_distance, phash
from snapref_ray.render_service.judges.spec import JudgeSpec
from snapref_ray.render_service.references import Reference
from snapref_ray.requests import RenderError, RenderRequest, RenderSettings

SETTINGS = RenderSettings(width=256, height=256, steps=2, sampler="euler")
PROMPTS = ["1girl, beach", "1girl, cafe", "1girl, forest"]


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def own(reference_png: bytes) -> bytes:
    return reference_png  # the judged render's own reference (tests/service/conftest.py: `service` too)


@pytest.fixture(scope="module")
def other() -> bytes:
    return _png(np.random.default_rng(5).integers(0, 255, (96, 80, 3), dtype=np.uint8))


def _reference(data: bytes, name: str) -> Reference:
    return Reference.of_images([data], "single", SETTINGS, [name])


def _requests(prompts=PROMPTS) -> list[RenderRequest]:
    return [RenderRequest(prompt=p, seed=11, settings=SETTINGS) for p in prompts]


def test_the_non_finite_fraction_is_the_latent_s_before_the_decode(service, own, monkeypatch):
    """The sampler's latent with 5 NaN and 2 inf elements in image 0: 7/numel there, 0 in image 1; both recorded."""
    import snapref_ray.engine as engine

    real_sample = engine.sample

    def poisoned(*args, **kwargs):
        x = real_sample(*args, **kwargs).clone()
        x.view(x.shape[0], -1)[0, :5] = float("nan")
        x.view(x.shape[0], -1)[0, 10:12] = float("inf")
        poisoned.numel = x[0].numel()
        return x

    monkeypatch.setattr(engine, "sample", poisoned)
    spec = JudgeSpec.of_names("sanity")
    rendered = service.render(_requests(PROMPTS[:2]), reference=_reference(own, "own"), judge=JudgeCall(spec))
    first, second = (r.judgement for r in rendered)
    assert first.scores.sanity_nonfinite == pytest.approx(7 / poisoned.numel)
    assert second.scores.sanity_nonfinite == 0.0
    assert first.verdicts.sanity is False and not first.accepted
    assert rendered[0].latent_nonfinite == first.scores.sanity_nonfinite


def test_every_asked_score_is_recorded_whatever_the_verdict(service, own):
    """near_duplicate against a kept set holding image 0's hash: image 0 rejected at distance 0, the other scored."""
    plain = service.render(_requests(), reference=_reference(own, "own"))
    kept = (phash(plain[0].image),)
    spec = JudgeSpec.of_names("sanity,near_duplicate")
    judged = service.render(_requests(), reference=_reference(own, "own"), judge=JudgeCall(spec, kept_phashes=kept))
    for before, after in zip(plain, judged):
        assert np.array_equal(np.asarray(before.image), np.asarray(after.image))  # judging never changes a render
        j = after.judgement
        assert j.scores.near_duplicate == nearest_distance(phash(after.image), kept)
        assert j.scores.phash == f"{phash(after.image):016x}"
        assert None not in (j.scores.sanity_std, j.scores.sanity_luminance, j.scores.sanity_clipped)
        assert j.scores.identity_gap is None and j.verdicts.identity_gap is None
    assert judged[0].judgement.scores.near_duplicate == 0 and judged[0].judgement.verdicts.near_duplicate is False
    assert [r.judgement.accepted for r in judged[1:]] == [
        r.judgement.verdicts.sanity and r.judgement.scores.near_duplicate > 6 for r in judged[1:]
    ]


def test_the_identity_gap_is_the_evaluation_s_own(service, tiny_renderer, own, other):
    check = {"sigmas": [0.3, 0.7], "noise_seeds": [0, 1]}
    spec = JudgeSpec.model_validate({"identity_gap": check})
    rendered = service.render(
        _requests(PROMPTS[:2]), reference=_reference(own, "own"), judge=JudgeCall(spec, contrast=_reference(other, "x"))
    )
    r = tiny_renderer
    own_kv = r.encode_reference(own, width=256, height=256)
    other_kv = r.encode_reference(other, width=256, height=256)
    for out in rendered:
        right = denoising_losses(r, out.image, out.request.prompt, own_kv, [0.3, 0.7], [0, 1])
        wrong = denoising_losses(r, out.image, out.request.prompt, other_kv, [0.3, 0.7], [0, 1])
        expected = (wrong.mean() - right.mean()).item()
        assert out.judgement.scores.identity_gap == pytest.approx(expected, rel=1e-5, abs=1e-7)
        assert out.judgement.verdicts.identity_gap == (expected > 0.0)
    gaps = [o.judgement.scores.identity_gap for o in rendered]
    assert gaps[0] != gaps[1]  # each image is its own target


def test_a_judge_that_cannot_run_is_refused_before_any_device_work(service, own):
    encodes = service.cache.stats.encodes
    with pytest.raises(RenderError) as refused:
        service.render(
            _requests(), reference=_reference(own, "own"), judge=JudgeCall(JudgeSpec.of_names("identity_gap"))
        )
    assert refused.value.field == "judge.identity_gap.contrast_reference"
    with pytest.raises(RenderError) as refused:
        service.render(_requests(), judge=JudgeCall(JudgeSpec.model_validate({"embedding": {"model": "/nowhere"}})))
    assert refused.value.field == "judge.embedding"
    assert service.cache.stats.encodes == encodes


# -- the embedding judge -----------------------------------------------------------------------


def _save_tiny_clip(folder: Path) -> Path:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    torch.manual_seed(0)
    config = CLIPConfig(
        text_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2},
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
        },
        projection_dim=8,
    )
    CLIPModel(config).save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def _save_tiny_dinov2(folder: Path) -> Path:
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    config = Dinov2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=28, patch_size=14
    )
    Dinov2Model(config).save_pretrained(folder)
    BitImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(folder)
    return folder


def _direct_similarity(folder: Path, images: list[Image.Image], reference: Image.Image) -> list[float]:
    """The cosine similarity computed with transformers directly: the family's documented embedding."""
    from transformers import AutoImageProcessor, AutoModel

    model, processor = AutoModel.from_pretrained(folder).eval(), AutoImageProcessor.from_pretrained(folder)
    with torch.no_grad():
        pixels = processor(images=[*images, reference], return_tensors="pt")["pixel_values"]
        if hasattr(model, "get_image_features"):
            feats = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
        else:
            feats = model(pixel_values=pixels).last_hidden_state[:, 0]  # the CLS token, after DINOv2's layernorm
    feats = torch.nn.functional.normalize(feats, dim=-1)
    return (feats[:-1] @ feats[-1]).tolist()


@pytest.mark.parametrize("family", ["clip", "dinov2"])
def test_the_embedding_similarity_is_transformers_own(service, own, tmp_path, family):
    folder = (_save_tiny_clip if family == "clip" else _save_tiny_dinov2)(tmp_path / family)
    spec = JudgeSpec.model_validate({"embedding": {"model": str(folder), "min_similarity": 0.0}})
    rendered = service.render(_requests(), reference=_reference(own, "own"), judge=JudgeCall(spec))
    expected = _direct_similarity(folder, [r.image for r in rendered], Image.open(io.BytesIO(own)).convert("RGB"))
    got = [r.judgement.scores.embedding for r in rendered]
    assert got == pytest.approx(expected, abs=1e-5)
    assert [r.judgement.verdicts.embedding for r in rendered] == [s >= 0.0 for s in expected]
    assert len(set(np.round(got, 6))) == len(got)  # three images, three similarities


def test_ccip_without_its_package_says_which_package_is_missing(service, own):
    try:
        import imgutils  # noqa: F401

        pytest.fail("dghs-imgutils is installed: this test proves the message when it is not")
    except ImportError:
        pass
    spec = JudgeSpec.model_validate({"embedding": {"model": "ccip-caformer-24-randaug-pruned", "kind": "ccip"}})
    with pytest.raises(RenderError, match="dghs-imgutils") as refused:
        service.render(_requests(PROMPTS[:1]), reference=_reference(own, "own"), judge=JudgeCall(spec))
    assert refused.value.field == "judge.embedding.kind"


def test_a_reference_is_embedded_once_for_all_its_renders(service, own, tmp_path):
    """The reference's files are read for its RefKV and once for its embedding; its next batch reads neither."""
    folder = _save_tiny_dinov2(tmp_path / "dinov2")
    loads = []

    def load() -> list[bytes]:
        loads.append(1)
        return [own]

    reference = Reference(_reference(own, "own").key, "single", ("own",), load)
    call = JudgeCall(JudgeSpec.model_validate({"embedding": {"model": str(folder)}}))
    first = service.render(_requests(PROMPTS[:1]), reference=reference, judge=call)
    assert len(loads) == 2  # the encode, the embedding
    again = service.render(_requests(PROMPTS[:1]), reference=reference, judge=call)
    assert len(loads) == 2
    assert again[0].judgement == first[0].judgement
