"""The cached reference read equals reading the reference fresh, checked against an independent
float64 oracle (tests/reference_oracle.py) over whole sampling runs of the production Renderer.

The production path is the public one: `Renderer.render(..., references=...)` encodes RefKV once
and samples with it; the sampled latent is taken where the Renderer hands it to the VAE. The
oracle shares nothing with it but the weight files, the text contexts, the reference pixels and
the schedule: it re-derives the DiT from docs/design.md and reads the reference through one
masked attention over [target; reference] tokens in every block of every call.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from snapref_ray.adapter.file import save_adapter
from snapref_ray.adapter.generate import make_adapter
from snapref_ray.adapter.images import prepare_reference
from snapref_ray.engine import Renderer
from snapref_ray.models.latent_format import process_in
from snapref_ray.requests import RenderRequest, RenderSettings
from snapref_ray.sampling.schedules import get_sigmas
from snapref_ray.tiny import TinyConfig, make_tiny
from tests.reference_oracle import load_adapter_weights, load_dit_weights, sample_euler_cfg

SIZE = 256  # 32 x 32 latent, 16 x 16 = 256 target tokens
CFG = 4.0
NEGATIVE = "lowres"
# fp32 production vs float64 oracle after a few steps: observed ~1e-6 relative; a wrong read is > 1e-2.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def ref_images(tiny_models: Path, tmp_path_factory) -> list[bytes]:
    other = tmp_path_factory.mktemp("oracle-ref") / "other.png"
    rng = np.random.default_rng(5)
    Image.fromarray(rng.integers(0, 255, (96, 160, 3), dtype=np.uint8)).save(other)
    return [(tiny_models / "reference.png").read_bytes(), other.read_bytes()]


@pytest.fixture(scope="module")
def forty_block_models(tmp_path_factory) -> Path:
    """A tiny 40-block DiT (the Anima-2.9B layout) with a 28-block adapter."""
    folder = make_tiny(tmp_path_factory.mktemp("forty"), TinyConfig(num_blocks=40), with_adapter=False)
    adapter = make_adapter(
        num_blocks=28,
        model_channels=64,
        context_dim=64,
        mlp_hidden=256,
        ref_rank=4,
        target_rank=2,
        seed=3,
        base_model="anima-tiny",
    )
    save_adapter(adapter, folder / "adapter.safetensors", weight_format="fp32")
    return folder


def production_latent(renderer: Renderer, requests: list[RenderRequest], **kwargs) -> torch.Tensor:
    """The latent the production sampler hands to the VAE, [B, 16, 1, h, w]."""
    captured = {}
    decode = renderer.decode

    def capture(latent):
        captured["x"] = latent.detach().clone()
        return decode(latent)

    renderer.decode = capture
    try:
        renderer.render(requests, **kwargs)
    finally:
        del renderer.decode  # back to the class's method
    return captured["x"].double()


def oracle_latent(
    renderer: Renderer, folder: Path, requests: list[RenderRequest], images: list[bytes] | None, layout: str = "single"
) -> torch.Tensor:
    """The same run through the float64 oracle (cond rows read fresh, uncond rows do not)."""
    s = requests[0].settings
    sd = load_dit_weights(folder / "dit.safetensors")
    blocks = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    adapter = load_adapter_weights(folder / "adapter.safetensors", blocks, s.mode)
    encode = lambda text: renderer.prompts.encode(text, device="cpu")[0].double()  # noqa: E731
    refs = []
    if images is not None:
        with torch.inference_mode():
            for pixels in prepare_reference(images, layout=layout, megapixels=s.ref_megapixels):
                refs.append(process_in(renderer.vae.encode(pixels.float()).float())[0].double())
    noise = torch.stack(
        [
            torch.randn(
                (16, 1, s.height // 8, s.width // 8),
                dtype=torch.float32,
                generator=torch.Generator().manual_seed(r.seed),
            )[:, 0]
            for r in requests
        ]
    )
    sigmas = [float(v) for v in get_sigmas(s.scheduler, s.steps)]
    ref_weight = s.ref_weight if images is not None and s.ref_weight > 0 else None
    with torch.inference_mode():
        x = sample_euler_cfg(
            sd,
            noise.double(),
            sigmas,
            s.cfg,
            [encode(r.prompt) for r in requests],
            encode(s.negative_prompt),
            refs,
            encode(s.ref_caption),
            adapter,
            ref_weight,
        )
    return x.unsqueeze(2)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def requests_for(settings: RenderSettings, prompts=("1girl, solo, smile", "1girl, beach, night")):
    return [RenderRequest(prompt=p, seed=11 + i, settings=settings) for i, p in enumerate(prompts)]


@pytest.mark.slow
def test_two_references_cached_equal_a_fresh_masked_read_over_a_whole_run(tiny_renderer, tiny_models, ref_images):
    """Two references of one character, two prompts: 4 CFG rows per step (2 read, 2 do not), 3 steps."""
    s = RenderSettings(width=SIZE, height=SIZE, steps=3, sampler="euler", cfg=CFG, negative_prompt=NEGATIVE)
    reqs = requests_for(s)
    got = production_latent(tiny_renderer, reqs, references=ref_images, layout="multi")
    want = oracle_latent(tiny_renderer, tiny_models, reqs, ref_images, layout="multi")
    assert rel_diff(got, want) < TOLERANCE
    # The oracle can tell a wrong read: one reference instead of two, or none, is far off.
    one_ref = oracle_latent(tiny_renderer, tiny_models, reqs, ref_images[:1])
    no_ref = oracle_latent(tiny_renderer, tiny_models, reqs, None)
    assert rel_diff(one_ref, want) > 100 * TOLERANCE and rel_diff(no_ref, want) > 100 * TOLERANCE


@pytest.mark.slow
def test_28_block_adapter_on_40_block_model_equals_a_fresh_read_in_all_40_blocks(forty_block_models, ref_images):
    renderer = Renderer.from_folder(forty_block_models, device="cpu")
    s = RenderSettings(width=SIZE, height=SIZE, steps=2, sampler="euler", cfg=CFG, negative_prompt=NEGATIVE)
    reqs = requests_for(s, prompts=("1girl, solo",))
    got = production_latent(renderer, reqs, references=ref_images[:1])
    want = oracle_latent(renderer, forty_block_models, reqs, ref_images[:1])
    assert rel_diff(got, want) < TOLERANCE


@pytest.mark.parametrize("ref_weight", [0.25, 1.0, 2.5])
def test_ref_weight_in_char_mode_multiplies_the_reference_mass_per_block(
    tiny_renderer, tiny_models, ref_images, ref_weight
):
    """char mode's block weights differ per block ([1, 0.25] on the 2-block tiny model)."""
    weights = tiny_renderer.adapter.adapter.block_weights("char").tolist()
    assert len(set(weights)) > 1
    s = RenderSettings(
        width=SIZE,
        height=SIZE,
        steps=2,
        sampler="euler",
        cfg=CFG,
        negative_prompt=NEGATIVE,
        mode="char",
        ref_weight=ref_weight,
    )
    reqs = requests_for(s, prompts=("1girl, solo",))
    got = production_latent(tiny_renderer, reqs, references=ref_images[:1])
    want = oracle_latent(tiny_renderer, tiny_models, reqs, ref_images[:1])
    assert rel_diff(got, want) < TOLERANCE


def test_ref_weight_to_zero_approaches_the_no_read_output_continuously(tiny_renderer, tiny_models, ref_images):
    base = RenderSettings(width=SIZE, height=SIZE, steps=2, sampler="euler", cfg=CFG, negative_prompt=NEGATIVE)
    reqs = lambda w: requests_for(base.model_copy(update={"ref_weight": w}), prompts=("1girl, solo",))  # noqa: E731
    no_read = production_latent(tiny_renderer, reqs(0.0), references=ref_images[:1])
    # w = 0 is the no-read output: the target LoRA stays on, nothing is read (oracle: no reference stream).
    assert rel_diff(no_read, oracle_latent(tiny_renderer, tiny_models, reqs(0.0), None)) < TOLERANCE
    gaps = [
        rel_diff(production_latent(tiny_renderer, reqs(w), references=ref_images[:1]), no_read)
        for w in (1e-1, 1e-2, 1e-3)
    ]
    # Continuous and first-order in w: each tenfold smaller w leaves about a tenth of the gap.
    assert gaps[0] > 1e-3
    for bigger, smaller in zip(gaps, gaps[1:]):
        assert 0.05 < smaller / bigger < 0.2
