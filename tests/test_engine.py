"""The Renderer on the tiny model set: SnapRef's reference read, guidance rows, cache exactness, lifetimes."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from snapref_ray.adapter.file import save_adapter
from snapref_ray.adapter.generate import make_adapter
from snapref_ray.adapter.images import ReferenceImageError
from snapref_ray.engine import Renderer, RenderError
from snapref_ray.models.block_map import INHERITED_28_TO_40, BlockLayoutError
from snapref_ray.requests import RenderRequest, RenderSettings
from snapref_ray.sampling.ref_guidance import Row, step_rows
from snapref_ray.tiny import TinyConfig, make_tiny

SMALL = dict(width=256, height=256, steps=3, sampler="euler")


def pixels(result) -> np.ndarray:
    return np.asarray(result.image, dtype=np.int16)


@pytest.fixture(scope="module")
def renderer(tiny_renderer) -> Renderer:
    return tiny_renderer


@pytest.fixture(scope="module")
def ref_bytes(tiny_models: Path) -> bytes:
    return (tiny_models / "reference.png").read_bytes()


@pytest.fixture(scope="module")
def other_ref_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("ref") / "other.png"
    rng = np.random.default_rng(3)
    Image.fromarray(rng.integers(0, 255, (160, 112, 3), dtype=np.uint8)).save(path)
    return path.read_bytes()


def render_one(renderer, settings: RenderSettings, **kwargs):
    return renderer.render([RenderRequest(prompt="1girl, solo, smile", seed=7, settings=settings)], **kwargs)[0]


def test_txt2img_is_deterministic_for_a_seed(renderer):
    s = RenderSettings(**SMALL)
    a, b = render_one(renderer, s), render_one(renderer, s)
    assert a.image.size == (256, 256)
    assert np.array_equal(pixels(a), pixels(b))
    other = renderer.render([RenderRequest(prompt="1girl, solo, smile", seed=8, settings=s)])[0]
    assert not np.array_equal(pixels(a), pixels(other))


def test_batched_requests_equal_separate_ones(renderer):
    s = RenderSettings(**{**SMALL, "sampler": "er_sde"})
    # Different negative prompts still share a batch (batch_key leaves them free): each keeps its own.
    reqs = [
        RenderRequest(prompt=p, seed=i, settings=s.model_copy(update={"negative_prompt": neg}))
        for i, (p, neg) in enumerate([("1girl", "lowres"), ("1boy, night", "")])
    ]
    batched = renderer.render(reqs)
    for req, got in zip(reqs, batched):
        alone = renderer.render([req])[0]
        assert np.abs(pixels(alone) - pixels(got)).max() <= 1  # batched matmuls may differ in the last bit


def test_cached_reference_equals_recomputing_it_every_step(renderer, ref_bytes):
    s = RenderSettings(**SMALL)
    cached = render_one(renderer, s, references=[ref_bytes])
    recomputed = render_one(
        renderer, s.model_copy(update={"recompute_reference_every_step": True}), references=[ref_bytes]
    )
    assert np.array_equal(pixels(cached), pixels(recomputed))
    plain = render_one(renderer, s)
    assert not np.array_equal(pixels(cached), pixels(plain))  # the reference does something


def test_encode_once_render_many_with_a_held_refkv(renderer, ref_bytes):
    s = RenderSettings(**SMALL)
    kv = renderer.encode_reference([ref_bytes], width=256, height=256)
    assert kv.num_blocks == renderer.dit.config.num_blocks
    assert kv.nbytes == kv.kv_N2HLD.numel() * 4
    held = render_one(renderer, s, refkv=kv)
    direct = render_one(renderer, s, references=[ref_bytes])
    assert np.array_equal(pixels(held), pixels(direct))
    with pytest.raises(RenderError, match="token grid"):
        render_one(renderer, s.model_copy(update={"width": 320}), refkv=kv)


def test_ref_weight_zero_reads_nothing_but_keeps_the_target_lora(renderer, ref_bytes, other_ref_bytes):
    s = RenderSettings(**SMALL, ref_weight=0.0)
    a = render_one(renderer, s, references=[ref_bytes])
    b = render_one(renderer, s, references=[other_ref_bytes])
    assert np.array_equal(pixels(a), pixels(b))  # which reference no longer matters
    plain = render_one(renderer, RenderSettings(**SMALL))  # no adapter branch at all
    assert not np.array_equal(pixels(a), pixels(plain))  # ...but the target LoRA is on


def _rows(renderer, settings, refkv, sigma=0.8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 1, 32, 32, generator=g)
    cond, uncond = renderer.prompts.encode("1girl, smile"), renderer.prompts.encode("")
    ctx_for = {Row.COND: [cond], Row.UNCOND: [uncond], Row.COND_NOREF: [cond]}
    plan = step_rows(settings, sigma, True)
    reader = renderer.adapter.reader(renderer.resolve(settings))
    return renderer.denoise_rows(x, torch.tensor(sigma), plan, ctx_for, refkv, reader)


def test_uncond_row_ignores_the_reference_by_default_and_reads_it_with_ref_in_uncond(
    renderer, ref_bytes, other_ref_bytes
):
    kv_a = renderer.encode_reference([ref_bytes], width=256, height=256)
    kv_b = renderer.encode_reference([other_ref_bytes], width=256, height=256)
    default = RenderSettings(**SMALL)
    a, b = _rows(renderer, default, kv_a), _rows(renderer, default, kv_b)
    assert torch.equal(a[Row.UNCOND], b[Row.UNCOND])
    assert not torch.allclose(a[Row.COND], b[Row.COND])
    both = default.model_copy(update={"ref_in_uncond": True})
    a, b = _rows(renderer, both, kv_a), _rows(renderer, both, kv_b)
    assert not torch.allclose(a[Row.UNCOND], b[Row.UNCOND])


def test_ref_guidance_adds_a_row_that_does_not_read(renderer, ref_bytes, other_ref_bytes):
    s = RenderSettings(**SMALL, ref_guidance=2.0)
    kv_a = renderer.encode_reference([ref_bytes], width=256, height=256)
    kv_b = renderer.encode_reference([other_ref_bytes], width=256, height=256)
    a, b = _rows(renderer, s, kv_a), _rows(renderer, s, kv_b)
    assert set(a) == {Row.COND, Row.UNCOND, Row.COND_NOREF}
    assert torch.equal(a[Row.COND_NOREF], b[Row.COND_NOREF])
    assert not torch.allclose(a[Row.UNCOND], b[Row.UNCOND])


def test_reading_and_non_reading_rows_batched_match_separate_forwards(renderer, ref_bytes):
    kv = renderer.encode_reference([ref_bytes], width=256, height=256)
    dit = renderer.dit
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 1, 32, 32, generator=g)
    ctx = renderer.prompts.encode_batch(["1girl", "1boy"])
    sigma = torch.tensor([0.7, 0.7])
    loras = renderer.adapter.target_loras()
    weights = renderer.adapter.read_weights("cs", 1.0)
    together = dit(x, sigma, ctx, loras=loras, refs=kv.reads(torch.tensor([True, False]), weights))
    first = dit(x[:1], sigma[:1], ctx[:1], loras=loras, refs=kv.reads(torch.tensor([True]), weights))
    second = dit(x[1:], sigma[1:], ctx[1:], loras=loras, refs=None)
    torch.testing.assert_close(together[:1], first, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together[1:], second, atol=1e-5, rtol=1e-5)


def test_a_prompt_longer_than_512_tokens_renders_beside_a_short_negative(renderer):
    long_prompt = ", ".join(["1girl, smile, blue hair, long hair"] * 160)
    assert len(renderer.prompts.tokenizer.tokenize(long_prompt).t5_ids) > 512
    s = RenderSettings(**SMALL)
    result = renderer.render(
        [RenderRequest(prompt=long_prompt, seed=1, settings=s), RenderRequest(prompt="1boy", seed=2, settings=s)]
    )
    assert len(result) == 2


def test_several_references_of_one_character_concatenate(renderer, ref_bytes, other_ref_bytes):
    one = renderer.encode_reference([ref_bytes], width=256, height=256)
    two = renderer.encode_reference([ref_bytes, other_ref_bytes], layout="multi", width=256, height=256)
    assert two.num_tokens > one.num_tokens
    assert len(two.grids) == 2 and two.offsets[1][2] == two.offsets[0][2] + two.grids[0][2]
    pair = renderer.encode_reference([ref_bytes, other_ref_bytes], layout="pair", width=256, height=256)
    assert len(pair.grids) == 1


def test_char_mode_changes_the_image(renderer, ref_bytes):
    cs = render_one(renderer, RenderSettings(**SMALL), references=[ref_bytes])
    char = render_one(renderer, RenderSettings(**SMALL, mode="char"), references=[ref_bytes])
    assert not np.array_equal(pixels(cs), pixels(char))


def test_refkv_encoded_inside_a_render_is_released_even_when_the_render_fails(renderer, ref_bytes):
    made = []
    original = renderer._run_reference_stream

    def spy(prepared, grid):
        kv = original(prepared, grid)
        made.append(weakref.ref(kv))
        return kv

    renderer._run_reference_stream = spy
    try:

        def fail(step, total):
            raise RuntimeError("disk full")

        with pytest.raises(RuntimeError, match="disk full"):
            render_one(renderer, RenderSettings(**SMALL), references=[ref_bytes], progress=fail)
        render_one(renderer, RenderSettings(**SMALL), references=[ref_bytes])
    finally:
        del renderer._run_reference_stream
    gc.collect()
    assert len(made) == 2 and all(ref() is None for ref in made)


def test_bad_reference_images_are_clear_errors(renderer):
    with pytest.raises(ReferenceImageError, match="reference 1"):
        render_one(renderer, RenderSettings(**SMALL), references=[b"not an image"])


def test_reference_without_adapter_is_an_error(tiny_models, ref_bytes, tmp_path):
    folder = make_tiny(tmp_path / "noadapter", with_adapter=False)
    r = Renderer.from_folder(folder, device="cpu")
    with pytest.raises(RenderError, match="no reference adapter"):
        render_one(r, RenderSettings(**SMALL), references=[ref_bytes])


def test_img2img_keeps_the_input_at_low_denoise(renderer, tiny_models):
    init = Image.open(tiny_models / "reference.png").convert("RGB").resize((256, 256))
    low = render_one(renderer, RenderSettings(**SMALL, denoise=0.2), init_image=init)
    high = render_one(renderer, RenderSettings(**SMALL, denoise=1.0))
    low_err = np.abs(pixels(low) - np.asarray(init, dtype=np.int16)).mean()
    high_err = np.abs(pixels(high) - np.asarray(init, dtype=np.int16)).mean()
    assert low_err < high_err
    with pytest.raises(RenderError, match="init image"):
        render_one(renderer, RenderSettings(**SMALL, denoise=0.5))


@pytest.mark.slow
def test_28_block_adapter_on_40_block_model_follows_the_inherited_map(tmp_path, ref_bytes):
    folder = make_tiny(tmp_path / "forty", TinyConfig(num_blocks=40), with_adapter=False)
    adapter = make_adapter(
        num_blocks=28,
        model_channels=64,
        context_dim=64,
        mlp_hidden=256,
        ref_rank=4,
        target_rank=2,
        seed=1,
        base_model="anima-tiny",
    )
    save_adapter(adapter, folder / "adapter.safetensors", weight_format="fp32")
    r = Renderer.from_folder(folder, device="cpu")
    hooked = [b for b, k in enumerate(r.adapter.hooked) if k is not None]
    assert hooked == list(INHERITED_28_TO_40)
    assert r.adapter.reference_loras()[2] is None and r.adapter.target_loras()[2] is None
    kv = r.encode_reference([ref_bytes], width=256, height=256)
    assert kv.num_blocks == 40  # K/V computed (and read) in every block, inserted ones too
    assert render_one(r, RenderSettings(**SMALL), refkv=kv).image.size == (256, 256)


def test_28_block_adapter_on_a_30_block_model_raises(tmp_path):
    folder = make_tiny(tmp_path / "thirty", TinyConfig(num_blocks=30), with_adapter=False)
    adapter = make_adapter(
        num_blocks=28,
        model_channels=64,
        context_dim=64,
        mlp_hidden=256,
        ref_rank=2,
        target_rank=2,
        base_model="anima-tiny",
    )
    save_adapter(adapter, folder / "adapter.safetensors", weight_format="fp32")
    with pytest.raises(BlockLayoutError, match=r"28.*30|30.*28"):
        Renderer.from_folder(folder, device="cpu")


def test_fp16_model_keeps_the_reference_stream_finite(tmp_path, ref_bytes):
    """The original node's bug: an fp16 reference stream overflowed into NaN and black images."""
    from snapref_ray.models.tiny_dit import make_tiny_dit_state_dict

    folder = make_tiny(tmp_path / "fp16")
    sd = make_tiny_dit_state_dict(
        model_channels=64, num_blocks=2, head_dim=32, context_dim=64, adapter_dim=64, t5_vocab=_t5_vocab()
    )
    # Activations that fit fp32 but not fp16 (max 65504) after the MLP of block 0.
    sd["blocks.0.mlp.layer1.weight"] = sd["blocks.0.mlp.layer1.weight"] * 400
    sd["blocks.0.mlp.layer2.weight"] = sd["blocks.0.mlp.layer2.weight"] * 400
    save_file({f"net.{k}": v.to(torch.float16).contiguous() for k, v in sd.items()}, str(folder / "dit.safetensors"))
    r = Renderer.from_folder(folder, device="cpu", dtype=torch.float16)
    kv = r.encode_reference([ref_bytes], width=256, height=256)
    assert kv.dtype == torch.float16 and torch.isfinite(kv.kv_N2HLD).all()
    # The same stream computed in fp16 overflows: the test has teeth.
    latent = torch.randn(1, 16, 1, 24, 16).to(torch.float16)
    ctx = r.prompts.encode("").to(torch.float16)
    naive = r.dit.reference_kv(latent * 20, ctx, loras=r.adapter.reference_loras())
    assert not all(torch.isfinite(k).all() and torch.isfinite(v).all() for k, v in naive)


def test_a_bf16_model_on_the_cpu_runs_its_vae_in_float32(tiny_models):
    """On a CPU the VAE decodes in float32 whatever the model's dtype (bf16 convolutions have no fast CPU
    kernel): a bf16 Renderer's images equal a float32 VAE's decode of the same latent, loaded apart."""
    from snapref_ray.models.latent_format import process_out
    from snapref_ray.models.vae import load_vae

    r = Renderer.from_folder(tiny_models, device="cpu", dtype=torch.bfloat16)
    assert r.dtype == torch.bfloat16 and r.dit.x_embedder.proj[1].weight.dtype == torch.bfloat16
    assert r.vae.dtype == torch.float32
    latent = torch.randn(1, 16, 1, 32, 32, generator=torch.Generator().manual_seed(5))
    (image,) = r.decode(latent)
    oracle_vae = load_vae(r.files.vae, device="cpu", dtype=torch.float32)
    with torch.inference_mode():
        x_B3HW = oracle_vae.decode(process_out(latent)[:, :, 0])
    expected = ((x_B3HW[0].float() + 1) / 2).clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    assert np.abs(np.asarray(image, dtype=np.int16) - expected.astype(np.int16)).max() <= 1


def _t5_vocab() -> int:
    from snapref_ray.models.tiny_text import TINY_T5_VOCAB

    return TINY_T5_VOCAB
