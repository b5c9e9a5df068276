"""The Wan 2.1 VAE's shape (`VAEConfig`), read from a checkpoint's tensor shapes without torch.

The driver plans a job's memory from safetensors headers before any worker exists (render_service/memory_estimate.py),
so the config and its inference live apart from the module (vae.py). `infer_vae_config` reads only key names and
`.shape` of each value: it takes loaded tensors and a header's shape entries alike.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from snapref_ray.models.safetensors_header import CheckpointError

# Prefixes a VAE may carry when extracted from a full checkpoint.
VAE_PREFIXES = ("first_stage_model.", "vae.")
# The dtype a VAE runs in on a CPU, whatever the model's (see `vae_compute_dtype_name`).
CPU_VAE_DTYPE = "float32"


@dataclass(frozen=True)
class VAEConfig:
    """Wan 2.1 VAE hyper-parameters; `infer_vae_config` reads them from tensor shapes.

    The defaults are the Qwen-Image / Wan 2.1 VAE that Anima uses (126,892,531 parameters).
    """

    base_dim: int = 96  # channels of the full-resolution stage
    z_dim: int = 16  # latent channels (the encoder head emits 2·z_dim: mean and log-variance)
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)  # channel multiplier per stage; len-1 stages halve H and W
    num_res_blocks: int = 2  # residual blocks per encoder stage (the decoder has one more)
    # Which down stages also halve time. Irrelevant for images, but it decides which `time_conv`
    # tensors the file holds, so the key layout needs it.
    temporal_downsample: tuple[bool, ...] = (False, True, True)

    def __post_init__(self) -> None:
        if len(self.temporal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(
                f"temporal_downsample needs {len(self.dim_mult) - 1} entries (one per down stage),"
                f" got {len(self.temporal_downsample)}"
            )

    @property
    def spatial_factor(self) -> int:
        """Pixels per latent cell along H and W (8 for the real VAE)."""
        return 2 ** (len(self.dim_mult) - 1)


def infer_vae_config(sd: Mapping[str, Any], source: str = "VAE state dict") -> VAEConfig:
    """Read the VAE hyper-parameters from the tensor shapes of a state dict in original Wan key names."""
    if "encoder.conv1.weight" not in sd and "encoder.conv_in.weight" in sd:
        raise CheckpointError(
            f"{source}: this is a diffusers-format VAE (it has 'encoder.conv_in.weight'); load the original"
            " Wan / ComfyUI file (keys 'encoder.conv1.weight', 'decoder.upsamples.N...') instead"
        )
    base_dim = _shape(sd, "encoder.conv1.weight", source, 5)[0]
    z_dim = _shape(sd, "conv2.weight", source, 5)[0]
    indices = sorted({int(m.group(1)) for k in sd if (m := re.match(r"encoder\.downsamples\.(\d+)\.", k))})
    if not indices:
        raise CheckpointError(f"{source}: no 'encoder.downsamples.N.*' tensors (not a Wan 2.1 / Qwen-Image VAE?)")
    resamples = [i for i in indices if f"encoder.downsamples.{i}.resample.1.weight" in sd]
    num_res_blocks = resamples[0] if resamples else len(indices)
    dim_mult = []
    for stage in range(len(resamples) + 1):
        last_block = stage * (num_res_blocks + 1) + num_res_blocks - 1
        width = _shape(sd, f"encoder.downsamples.{last_block}.residual.6.weight", source, 5)[0]
        dim_mult.append(width // base_dim)
    temporal = tuple(f"encoder.downsamples.{i}.time_conv.weight" in sd for i in resamples)
    return VAEConfig(
        base_dim=base_dim,
        z_dim=z_dim,
        dim_mult=tuple(dim_mult),
        num_res_blocks=num_res_blocks,
        temporal_downsample=temporal,
    )


def vae_compute_dtype_name(device_type: str, dtype: str) -> str:
    """The dtype (by name) the VAE runs in beside a model computing in `dtype` on a `device_type` device:
    float32 on a CPU, else `dtype`.

    ComfyUI's `vae_dtype` makes the same choice: CPUs have no fast half-precision convolution kernels.
    Measured on 2 CPU cores (tiny VAE, 256x256): one bf16 decode took about 3.5 s, the float32 one about
    0.1 s, and a job at `dtype: bfloat16` or `quantize: fp8` on a CPU spent most of its time there.
    """
    return CPU_VAE_DTYPE if device_type == "cpu" else dtype


def _shape(sd: Mapping[str, Any], key: str, source: str, rank: int) -> tuple[int, ...]:
    if key not in sd:
        raise CheckpointError(
            f"{source}: missing tensor {key!r} (not a Wan 2.1 / Qwen-Image VAE in original key names?)"
        )
    shape = tuple(sd[key].shape)
    if len(shape) != rank:
        raise CheckpointError(f"{source}: tensor {key!r} has shape {list(shape)}, expected a {rank}-D tensor")
    return shape
