"""WanVAE: key layout of the real file, parity with diffusers' AutoencoderKLQwenImage, loading errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from snapref_ray.models.latent_format import process_out
from snapref_ray.models.safetensors_header import CheckpointError
from snapref_ray.models.tiny_vae import make_tiny_vae, make_tiny_vae_state_dict, random_vae_state_dict
from snapref_ray.models.vae import CausalConv3d, WanVAE, load_vae
from snapref_ray.models.vae_config import VAEConfig, infer_vae_config

REF_KEYS = Path(__file__).resolve().parents[1] / "data" / "ref-keys" / "keys-qwen-image-vae-comfyui.txt"
REAL_PARAMS = 126_892_531


def to_diffusers_keys(sd: dict[str, torch.Tensor], cfg: VAEConfig) -> dict[str, torch.Tensor]:
    """Original Wan names → diffusers AutoencoderKLQwenImage names (docs/design.md#oracles-in-the-tests)."""
    per_up_stage = cfg.num_res_blocks + 2  # decoder stage: num_res_blocks + 1 resnets, then one upsampler

    def up_block(m: re.Match) -> str:
        stage, j = divmod(int(m.group(1)), per_up_stage)
        inner = "upsamplers.0" if j == per_up_stage - 1 else f"resnets.{j}"
        return f"decoder.up_blocks.{stage}.{inner}."

    out = {}
    for key, value in sd.items():
        k = re.sub(r"^conv1\.", "quant_conv.", key)
        k = re.sub(r"^conv2\.", "post_quant_conv.", k)
        k = re.sub(r"^(encoder|decoder)\.conv1\.", r"\1.conv_in.", k)
        k = k.replace(".head.0.", ".norm_out.").replace(".head.2.", ".conv_out.")
        k = k.replace(".middle.1.", ".mid_block.attentions.0.")
        k = re.sub(r"\.middle\.([02])\.", lambda m: f".mid_block.resnets.{int(m.group(1)) // 2}.", k)
        k = k.replace("encoder.downsamples.", "encoder.down_blocks.")
        k = re.sub(r"^decoder\.upsamples\.(\d+)\.", up_block, k)
        k = (
            k.replace(".residual.0.", ".norm1.")
            .replace(".residual.2.", ".conv1.")
            .replace(".residual.3.", ".norm2.")
            .replace(".residual.6.", ".conv2.")
            .replace(".shortcut.", ".conv_shortcut.")
        )
        out[k] = value
    return out


def diffusers_vae(sd: dict[str, torch.Tensor], cfg: VAEConfig):
    from diffusers import AutoencoderKLQwenImage

    model = AutoencoderKLQwenImage(
        base_dim=cfg.base_dim,
        z_dim=cfg.z_dim,
        dim_mult=list(cfg.dim_mult),
        num_res_blocks=cfg.num_res_blocks,
        temperal_downsample=list(cfg.temporal_downsample),
    )
    model.load_state_dict(to_diffusers_keys(sd, cfg), strict=True)
    return model.eval()


def relative_max_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def check_parity(sd: dict[str, torch.Tensor], cfg: VAEConfig) -> tuple[float, float]:
    ours, ref = load_vae(sd), diffusers_vae(sd, cfg)
    gen = torch.Generator().manual_seed(1)
    pixels = torch.rand(2, 3, 64, 48, generator=gen) * 2 - 1  # non-square on purpose, a batch of two
    latent = process_out(torch.randn(2, 16, 8, 6, generator=gen))  # VAE-space scale, like a real latent
    with torch.no_grad():
        mu = ours.encode(pixels)
        mu_ref = ref.encode(pixels[:, :, None]).latent_dist.mean[:, :, 0]
        image = ours.decode(latent)
        image_ref = ref.decode(latent[:, :, None]).sample[:, :, 0]
    assert mu.shape == (2, 16, 8, 6) and image.shape == (2, 3, 64, 48)
    # Most pixels must be inside (-1, 1): a comparison of clamped values only would prove little.
    assert (image_ref.abs() < 1).float().mean() > 0.5
    return relative_max_diff(mu, mu_ref), relative_max_diff(image, image_ref)


@pytest.mark.slow
def test_real_size_parity_with_diffusers():
    cfg = VAEConfig()
    enc_diff, dec_diff = check_parity(random_vae_state_dict(cfg, seed=0), cfg)
    print(f"real-size parity: encode {enc_diff:.2e}, decode {dec_diff:.2e} (max abs diff / max abs ref)")
    assert enc_diff < 1e-4
    assert dec_diff < 1e-4


def test_tiny_parity_with_diffusers():
    cfg = VAEConfig(base_dim=8)
    enc_diff, dec_diff = check_parity(make_tiny_vae_state_dict(base_dim=8, seed=3), cfg)
    print(f"tiny parity: encode {enc_diff:.2e}, decode {dec_diff:.2e}")
    assert enc_diff < 1e-4
    assert dec_diff < 1e-4


def test_real_size_layout_matches_the_released_file():
    vae = WanVAE(VAEConfig(), device="meta")
    ours = [(k, list(p.shape)) for k, p in vae.named_parameters()]
    ref = []
    for line in REF_KEYS.read_text().splitlines():
        key, shape = line.split("\t")
        ref.append((key, [int(s) for s in shape.strip("[]").split(",")]))
    assert len(ref) == 194
    assert ours == ref
    assert sum(p.numel() for p in vae.parameters()) == REAL_PARAMS


def test_config_is_inferred_from_shapes():
    assert infer_vae_config(make_tiny_vae_state_dict()) == VAEConfig(base_dim=8)
    odd = VAEConfig(base_dim=4, z_dim=4, dim_mult=(1, 2, 3), num_res_blocks=1, temporal_downsample=(True, False))
    sd = random_vae_state_dict(odd)
    assert infer_vae_config(sd) == odd
    vae = load_vae(sd)
    assert vae.config.spatial_factor == 4
    assert vae.encode(torch.zeros(1, 3, 16, 8)).shape == (1, 4, 4, 2)
    assert vae.decode(torch.zeros(1, 4, 4, 2)).shape == (1, 3, 16, 8)


def test_single_frame_conv_equals_causal_conv3d():
    conv = CausalConv3d(5, 7)
    x_BCHW = torch.randn(2, 5, 6, 4)
    # Causal padding: two zero frames in front, one pixel spatially; then the full 3-D convolution.
    x_BCTHW = F.pad(x_BCHW[:, :, None], (1, 1, 1, 1, 2, 0))
    ref = F.conv3d(x_BCTHW, conv.weight, conv.bias)[:, :, 0]
    torch.testing.assert_close(conv(x_BCHW), ref, rtol=0, atol=1e-6)


def test_tiny_vae_round_trip_shapes_and_dtypes():
    vae = make_tiny_vae()
    pixels = torch.rand(2, 3, 32, 40) * 2 - 1
    latent = vae.encode(pixels)
    assert latent.shape == (2, 16, 4, 5) and latent.dtype == torch.float32
    assert torch.equal(vae.encode(pixels[:, :, None]), latent)  # [B,3,1,H,W] is the same image
    image = vae.decode(latent)
    assert image.shape == (2, 3, 32, 40)
    assert torch.equal(vae.decode(latent[:, :, None]), image)
    big = vae.decode(100 * torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0)))
    assert torch.isfinite(big).all() and big.abs().max() <= 1.0


def test_tiny_state_dict_is_seeded():
    a, b, c = make_tiny_vae_state_dict(seed=0), make_tiny_vae_state_dict(seed=0), make_tiny_vae_state_dict(seed=1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["encoder.conv1.weight"], c["encoder.conv1.weight"])
    assert a["encoder.downsamples.5.time_conv.weight"].shape == (16, 16, 3, 1, 1)
    assert a["decoder.middle.1.norm.gamma"].shape == (32, 1, 1)


def test_bf16_file_round_trip(tmp_path):
    sd = make_tiny_vae_state_dict(dtype=torch.bfloat16)
    path = tmp_path / "vae.safetensors"
    save_file(sd, str(path))
    vae = load_vae(path)
    assert vae.dtype == torch.bfloat16
    assert all(torch.equal(vae.state_dict()[k], sd[k]) for k in sd)  # 5-D weights kept as in the file
    pixels = torch.rand(1, 3, 16, 16) * 2 - 1
    latent = vae.encode(pixels)
    assert latent.dtype == torch.float32  # results in the input's dtype
    fp32 = load_vae(path, dtype=torch.float32)
    torch.testing.assert_close(latent, fp32.encode(pixels), rtol=0, atol=0.05)


def test_missing_and_misshaped_keys_are_named():
    sd = make_tiny_vae_state_dict()
    del sd["decoder.upsamples.4.shortcut.bias"]
    with pytest.raises(CheckpointError, match=r"missing tensor 'decoder\.upsamples\.4\.shortcut\.bias'"):
        load_vae(sd)
    sd = make_tiny_vae_state_dict()
    sd["encoder.middle.1.to_qkv.weight"] = torch.zeros(96, 32, 1)
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            "VAE state dict: tensor 'encoder.middle.1.to_qkv.weight' has shape [96, 32, 1], expected [96, 32, 1, 1]"
        ),
    ):
        load_vae(sd)
    with pytest.raises(CheckpointError, match=r"missing tensor 'conv2\.weight'"):
        load_vae({k: v for k, v in make_tiny_vae_state_dict().items() if k != "conv2.weight"})


def test_diffusers_layout_is_refused_with_a_hint():
    cfg = VAEConfig(base_dim=8)
    with pytest.raises(CheckpointError, match="diffusers-format VAE"):
        load_vae(to_diffusers_keys(make_tiny_vae_state_dict(), cfg))


def test_bad_inputs_are_refused():
    vae = make_tiny_vae()
    with pytest.raises(ValueError, match=r"multiples of 8, got \[20, 16\]"):
        vae.encode(torch.zeros(1, 3, 20, 16))
    with pytest.raises(ValueError, match="single images only, got 2 frames"):
        vae.decode(torch.zeros(1, 16, 2, 4, 4))
    with pytest.raises(ValueError, match=r"expected shape \[B, 16, H, W\]"):
        vae.decode(torch.zeros(1, 4, 4, 4))
