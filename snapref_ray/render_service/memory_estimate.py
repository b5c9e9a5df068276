"""How much host memory a render worker asks Ray for, before it exists: an estimate from the model files.

Ray packs actors onto nodes by the `memory=` they declare, and its memory monitor kills the worker that
grows past what the node has. A worker measures its real needs once it renders (memory.py); the driver has to
ask before that, so it estimates from the files' headers (nothing is loaded):

- runtime: torch, Ray's worker process and its buffers (measured here: ~0.5 GiB of RSS before any model);
- the weights that live in host memory: all of them for a CPU worker (in the dtype it computes in; the VAE's in
  float32, the dtype it runs in on a CPU), the
  largest file for a GPU worker (safetensors streams each file through host memory while it is moved);
- one image at the job's largest size: one VAE decode (models/vae_memory.py's estimate; the VAE decodes
  image by image), the DiT's activations for its rows, and one reference's K/V;
- each further image of a batch: its rows' DiT activations and its latent.

`memory_request` is the one rule every rendering actor asks by (a job's workers, the endpoint's replicas, Ray Data's
renderer, the identity evaluation's and the timing table's workers): the setting when one is given
(`cluster.memory_per_worker`, `memory_per_replica`), else this estimate at the dtype the model computes in; none
for model files only the workers can read (s3://).

The driver makes it and imports no torch: shapes come from the headers, dtypes by name, and the VAE decode's
estimate from its config (models/vae_estimates.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from snapref_ray.geometry import token_count
from snapref_ray.model_spec import ModelSpec
from snapref_ray.models.bundle import ModelFiles
from snapref_ray.models.dit_config import DiTConfig
from snapref_ray.models.safetensors_header import read_header, strip_prefix
from snapref_ray.models.vae_config import VAE_PREFIXES, infer_vae_config, vae_compute_dtype_name
from snapref_ray.models.vae_estimates import decode_peak_bytes

RUNTIME_BYTES = 1 * 2**30  # torch + a Ray worker at rest (~0.5 GiB measured), with room for its threads' buffers
GPU_RUNTIME_BYTES = 3 * 2**30  # plus the CUDA context and pinned staging buffers in host memory
# Tensors of width D alive per row and token at a block's peak: x, its norm, q/k/v, the attention output,
# the MLP's 4·D hidden and its output, with the allocator's slack.
DIT_LIVE_TENSORS_PER_TOKEN = 16
REFERENCE_TOKENS = 4096  # a 1 MP reference (its K/V: blocks x 2 x tokens x D)
# Bytes per element of the dtypes a model computes in (ModelSpec.dtype's names).
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class MemoryEstimate:
    """The figures behind a worker's `memory=` (bytes); `total` is what it asks for."""

    runtime_bytes: int
    weight_bytes: int
    image_bytes: int  # one image at the size: one decode, its rows' DiT activations, one reference's K/V
    per_image_bytes: int  # each further image of a batch
    batch: int
    width: int
    height: int

    @property
    def total(self) -> int:
        return self.runtime_bytes + self.weight_bytes + self.image_bytes + (self.batch - 1) * self.per_image_bytes

    def report(self) -> dict:
        return {**asdict(self), "total_bytes": self.total}


def estimate_worker_memory(
    files: ModelFiles, *, width: int, height: int, batch: int, on_gpu: bool, dtype: str = "auto"
) -> MemoryEstimate:
    """Host memory one worker needs to render `batch` images of `width` x `height` with `files` (see the module).

    `dtype` is the dtype the model computes in, by name (ModelSpec.dtype): "auto" is bfloat16 on a GPU, float32
    on a CPU.
    """
    compute = compute_dtype_name(dtype, on_gpu=on_gpu)
    element = DTYPE_BYTES[compute]
    dit_header = _header(files.dit)
    config = DiTConfig.from_state_dict(strip_prefix(_shapes(dit_header)), source=str(files.dit))
    weight_files = [files.dit, files.text_encoder, files.vae, *([files.adapter] if files.adapter else [])]
    if on_gpu:
        weights = max(Path(f).stat().st_size for f in weight_files)  # one file streamed through host memory
        runtime = GPU_RUNTIME_BYTES
        image = per_image = 0  # activations and the decode live on the device
    else:
        # The VAE runs in float32 on a CPU whatever the model's dtype (vae_config.py's vae_compute_dtype_name).
        vae_element = DTYPE_BYTES[vae_compute_dtype_name("cpu", compute)]
        weights = sum(_elements(_header(f)) for f in weight_files if f != files.vae) * element
        weights += _elements(_header(files.vae)) * vae_element
        runtime = RUNTIME_BYTES
        tokens = token_count(height=height, width=width)
        rows = 3  # cond, uncond and the reference-guidance row: the most an image runs
        per_image = rows * tokens * config.model_channels * element * DIT_LIVE_TENSORS_PER_TOKEN
        vae = infer_vae_config(strip_prefix(_shapes(_header(files.vae)), VAE_PREFIXES), str(files.vae))
        decode = decode_peak_bytes(vae, (height // 8, width // 8), vae_element)
        refkv = config.num_blocks * 2 * REFERENCE_TOKENS * config.model_channels * element
        image = per_image + decode + refkv
    return MemoryEstimate(runtime, weights, image, per_image, batch, width, height)


def memory_request(
    model: ModelSpec, *, width: int, height: int, batch: int, on_gpu: bool, override: int | None = None
) -> tuple[int, MemoryEstimate | None]:
    """(bytes of host memory a rendering actor asks Ray for, the estimate behind them or None).

    `override` (the door's own setting) wins. Remote (s3://) model files are not fetched to estimate: such an
    actor asks for no memory, unless `override` says how much.
    """
    if override is not None:
        return override, None
    if model.is_remote():
        return 0, None
    # fp8 block matmuls write bf16 (models/fp8.py, engine.py); the dtype goes by name: the driver has no torch.
    dtype = "bfloat16" if model.quantize == "fp8" else model.dtype
    estimate = estimate_worker_memory(
        model.local_files(), width=width, height=height, batch=batch, on_gpu=on_gpu, dtype=dtype
    )
    return estimate.total, estimate


def compute_dtype_name(dtype: str, *, on_gpu: bool) -> str:
    """The dtype a worker computes in, by name: `dtype`, or for "auto" bfloat16 on a GPU and float32 on a CPU."""
    if dtype == "auto":
        return "bfloat16" if on_gpu else "float32"
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return dtype


def _header(path) -> dict:
    return read_header(path)[0]


@dataclass(frozen=True)
class _Shaped:
    """A header entry's shape where the config inference expects a tensor: it reads only `.shape`."""

    shape: tuple[int, ...]


def _shapes(header: dict) -> dict[str, _Shaped]:
    return {key: _Shaped(tuple(entry["shape"])) for key, entry in header.items()}


def _elements(header: dict) -> int:
    return sum(math.prod(entry["shape"]) for entry in header.values())
