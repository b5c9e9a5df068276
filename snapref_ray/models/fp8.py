"""Float8 matmuls for the DiT's block linears: e4m3 weights with per-row scales, per-token activation scales.

`quantize_dit(dit, "fp8")` swaps the ten block linears of every block (`dit.BLOCK_LINEARS`) for
`Float8Linear`, whose matmul is one `torch._scaled_mm`:

    y[m, n] = (q_x[m, :] . q_w[n, :]) * scale_x[m] * scale_w[n]        (accumulated in fp32, out bf16)

with q_w = round_e4m3(W[n, :] / scale_w[n]), scale_w[n] = max_k |W[n, k]| / 448 fixed at load,
and q_x, scale_x the same per row (per token) of the activation, computed at every call. Per-row
scales keep one outlier channel or token from flattening the others into float8's few mantissa
bits, which a single per-tensor scale would do.

What stays as it was:
- Everything outside the ten block linears: norms, embedders, the final layer, attention, the
  text encoder and the VAE. The per-block adaLN modulation linears too, on purpose: they see one
  row per batch item (the timestep embedding broadcasts over the tokens), so at 3,952 tokens they
  are ~0.003 % of a block's matmul FLOPs and a float8 GEMM with M = batch saves no time; and their
  output is the shift / scale / gate of every token of the block, so their rounding error would
  reach every token instead of one. The only thing they would give is memory (~8 % of the DiT's
  weights).
- Runtime LoRA branches (SnapRef target LoRAs, ArcAnima's row-scaled LoRA): `ops.Linear.forward`
  adds `lora.delta(x)` computed from the unquantised activation in the model dtype, after the
  float8 base matmul; only `base_output` is replaced here.
- Activations in another dtype than bf16 (the fp32 reference streams of SnapRef and ArcAnima v2)
  run `ops.Linear`'s path on the dequantised float8 weight: rowwise `_scaled_mm` on CUDA writes
  bf16 only, and the reference stream is fp32 by design.

Float8 checkpoints (`checkpoint.load_into_module`, `keep_fp8`): an e4m3 weight is used as it is
(its per-row scale, a per-tensor scale broadcast to the rows, or scale 1), with no dequantise and
requantise; an e5m2 weight is dequantised and requantised to e4m3 per row (one more rounding);
weights that LoRAs were merged into are already in the model dtype (`lora.merge_loras`) and are
quantised like any other.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from snapref_ray.models.dit import AnimaDiT
from snapref_ray.models.dit_config import BLOCK_LINEARS
from snapref_ray.models.ops import FLOAT8_DTYPES, Linear

log = logging.getLogger(__name__)

QUANTIZE_MODES = ("fp8",)
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# The output dtype of the float8 matmul: the only one rowwise-scaled _scaled_mm writes on CUDA.
OUT_DTYPE = torch.bfloat16
# Float8 tensor cores: Ada (8.9) and Hopper (9.0) onwards.
MIN_CUDA_CAPABILITY = (8, 9)
# _scaled_mm needs K and N multiples of 16 on CUDA; every Anima block linear is (2048, 8192, 1024 wide).
DIM_MULTIPLE = 16
# Rowwise _scaled_mm on CUDA read scale_a past its end when M % 256 != 0 (pytorch/pytorch#133334: a
# 4-byte read out of bounds, i.e. a float scale; the fp8 rows of A are loaded with bounds checks).
# The activation scales are therefore allocated rounded up to 256 rows and passed as an [M, 1] view,
# so such a read stays inside the allocation whatever the torch build. 3,952 tokens = 15.4 x 256.
SCALE_ROW_MULTIPLE = 256
# Smallest amax a row is scaled by: an all-zero row quantises to zeros instead of 0 / 0.
AMAX_FLOOR = 1e-12


class QuantizeError(ValueError):
    """`quantize` cannot be applied as asked: unknown mode, wrong dtype, device or layer shape."""


def quantize_rows(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row float8 e4m3: (q [M, K] e4m3, scale [M, 1] fp32) with x ~= q * scale and max |q| per row = 448."""
    amax_M1 = x_MK.abs().amax(dim=-1, keepdim=True).float()
    scale_M1 = amax_M1.clamp(min=AMAX_FLOOR) / FP8_MAX
    q_MK = (x_MK.float() / scale_M1).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q_MK, scale_M1


def fp8_linear(
    x: torch.Tensor, weight_NK: torch.Tensor, weight_scale_N: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x W^T (+ b) with W = weight_NK (e4m3) * weight_scale_N per row; x quantised per token. Returns x.dtype."""
    lead = x.shape[:-1]
    q_MK, scale_M1 = quantize_rows(x.reshape(-1, x.shape[-1]))
    rows = q_MK.shape[0]
    pad = -rows % SCALE_ROW_MULTIPLE
    if pad:  # see SCALE_ROW_MULTIPLE: the [M, 1] scales as a view of a buffer of whole 256-row tiles
        scale_M1 = F.pad(scale_M1, (0, 0, 0, pad), value=1.0)[:rows]
    # mat2 must be column-major: W^T of the row-major [N, K] weight is exactly that, with no copy.
    y_MN = torch._scaled_mm(
        q_MK, weight_NK.t(), scale_a=scale_M1, scale_b=weight_scale_N.reshape(1, -1), out_dtype=x.dtype
    )
    if bias is not None:
        y_MN = y_MN + bias.to(y_MN.dtype)
    return y_MN.reshape(*lead, weight_NK.shape[0])


class Float8Linear(Linear):
    """An `ops.Linear` whose weight is e4m3 with a [out] fp32 scale, multiplied by `fp8_linear` for bf16 inputs.

    It stays an `ops.Linear`: `forward` (and its LoRA branch), `compute_weight` (the dequantised
    weight, used for other input dtypes) and the checkpoint / LoRA-merge code treat it as one.
    """

    @classmethod
    def from_linear(cls, linear: Linear, *, name: str = "linear") -> Float8Linear:
        """The float8 version of `linear` (an e4m3 weight is reused as it is; see the module docstring)."""
        if linear.in_features % DIM_MULTIPLE or linear.out_features % DIM_MULTIPLE:
            raise QuantizeError(
                f"{name}: float8 matmuls need in and out features that are multiples of {DIM_MULTIPLE},"
                f" found in={linear.in_features}, out={linear.out_features}"
            )
        weight_NK, scale_N = _e4m3_rows(linear)
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        out.weight = nn.Parameter(weight_NK, requires_grad=False)
        out.bias = linear.bias
        out.weight_scale = scale_N
        return out

    def base_output(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != OUT_DTYPE or self.weight.dtype != FP8:  # fp32 reference stream, or a re-merged weight
            return super().base_output(x)
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", float8_e4m3fn rowwise"


def _e4m3_rows(linear: Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight [N, K], fp32 scale [N]) of a Linear, reusing a stored e4m3 weight without rounding it again."""
    weight = linear.weight
    rows = weight.shape[0]
    if weight.dtype == FP8:
        scale = linear.weight_scale
        if scale is None:
            scale = torch.ones(rows, device=weight.device)
        scale = scale.to(device=weight.device, dtype=torch.float32).reshape(-1)
        return weight.data, (scale.expand(rows) if scale.numel() == 1 else scale).contiguous()
    source = linear.compute_weight(torch.float32) if weight.dtype in FLOAT8_DTYPES else weight
    q_NK, scale_N1 = quantize_rows(source)
    return q_NK, scale_N1.reshape(-1)


def require_fp8_device(device: torch.device) -> None:
    """Raise a QuantizeError unless `device` runs rowwise float8 matmuls (CUDA: compute capability >= 8.9)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < MIN_CUDA_CAPABILITY:
            need = ".".join(map(str, MIN_CUDA_CAPABILITY))
            raise QuantizeError(
                f"quantize='fp8' needs float8 tensor cores, a GPU of compute capability >= {need}"
                f" (Ada, Hopper or newer); {device} has compute capability {major}.{minor}."
                " Run without quantize (bf16) on this GPU"
            )
    # One tiny call: a torch build or device without rowwise float8 _scaled_mm says so here, not mid-render.
    probe = torch.ones(DIM_MULTIPLE, DIM_MULTIPLE, device=device, dtype=OUT_DTYPE)
    try:
        fp8_linear(probe, probe.to(FP8), torch.ones(DIM_MULTIPLE, device=device))
    except (RuntimeError, NotImplementedError) as e:
        raise QuantizeError(
            f"quantize='fp8': torch {torch.__version__} cannot run rowwise float8 torch._scaled_mm on {device}: {e}"
        ) from None


def quantize_dit(dit: AnimaDiT, mode: str) -> list[str]:
    """Swap every block's ten `BLOCK_LINEARS` for `Float8Linear` in place; returns their module paths.

    mode: "fp8" (the one mode). The model must compute in bf16 (`dit.compute_dtype`): the float8
    matmul writes bf16. Call it after LoRAs are merged (merging needs the unquantised weight) and
    before compiling the forward.
    """
    if mode not in QUANTIZE_MODES:
        raise QuantizeError(f"quantize: expected one of {list(QUANTIZE_MODES)} or None, found {mode!r}")
    if dit.compute_dtype != OUT_DTYPE:
        raise QuantizeError(
            f"quantize='fp8' computes the block linears in {OUT_DTYPE} (the output dtype of rowwise float8"
            f" matmuls); the model computes in {dit.compute_dtype}: load it with dtype=torch.bfloat16"
        )
    require_fp8_device(dit.blocks[0].self_attn.q_proj.weight.device)
    swapped, reused = [], 0
    for i, block in enumerate(dit.blocks):
        for path in BLOCK_LINEARS:
            parent_path, _, leaf = path.rpartition(".")
            parent = block.get_submodule(parent_path)
            linear = getattr(parent, leaf)
            if isinstance(linear, Float8Linear):
                raise QuantizeError(f"blocks.{i}.{path}: already quantised (quantize_dit was called twice)")
            reused += linear.weight.dtype == FP8
            setattr(parent, leaf, Float8Linear.from_linear(linear, name=f"blocks.{i}.{path}"))
            swapped.append(f"blocks.{i}.{path}")
    log.info(
        "fp8: %d block linears run as float8 e4m3 rowwise (%d reused the checkpoint's e4m3 weights)",
        len(swapped),
        reused,
    )
    return swapped


__all__ = [
    "FP8",
    "QUANTIZE_MODES",
    "Float8Linear",
    "QuantizeError",
    "fp8_linear",
    "quantize_dit",
    "quantize_rows",
    "require_fp8_device",
]
