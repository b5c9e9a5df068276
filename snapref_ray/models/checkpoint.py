"""Reading safetensors checkpoints safely and loading them into modules with clear errors.

Everything here is memory-mapped safetensors: no pickle, ever. A file is checked before torch
touches it (header length, JSON header, tensor byte ranges inside the file), so a truncated
download or a `.ckpt` renamed to `.safetensors` gives a message naming the file, not a
traceback from deep inside a C++ reader.
"""

from __future__ import annotations

import logging
import os

import torch
from safetensors import safe_open
from torch import nn

from snapref_ray.models.ops import FLOAT8_DTYPES, Linear
from snapref_ray.models.safetensors_header import SCALE_SUFFIXES, CheckpointError, read_header

log = logging.getLogger(__name__)

StateDict = dict[str, torch.Tensor]


def load_state_dict(path: str | os.PathLike, device: str | torch.device = "cpu") -> StateDict:
    """All tensors of a safetensors file, memory-mapped (CPU) or loaded onto `device`."""
    read_header(path)
    out: StateDict = {}
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    except Exception as e:  # safetensors raises its own error types; re-raise with the file name
        raise CheckpointError(f"{path}: cannot read safetensors file: {e}") from None
    return out


def split_scales(sd: StateDict) -> tuple[StateDict, dict[str, torch.Tensor]]:
    """Separate float8 scale tensors: returns (weights, {weight key: scale})."""
    weights: StateDict = {}
    scales: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        base, _, leaf = key.rpartition(".")
        if leaf in SCALE_SUFFIXES:
            scales[f"{base}.weight"] = value
        else:
            weights[key] = value
    return weights, scales


def load_into_module(
    module: nn.Module,
    sd: StateDict,
    *,
    source: str,
    dtype: torch.dtype | None,
    device: torch.device | str | None = None,
    keep_fp8: bool = True,
) -> None:
    """Assign every parameter of `module` from `sd`, checking names and shapes.

    Float8 weights of `Linear` layers stay float8 (with their scale) when `keep_fp8`, and are
    dequantised per call; everything else is cast to `dtype`. Missing or mis-shaped tensors raise
    a `CheckpointError` naming the file, key, expected and found shape; unknown extra keys are
    ignored with one log line.
    """
    weights, scales = split_scales(sd)
    expected = dict(module.named_parameters())
    problems = []
    for key, param in expected.items():
        if key not in weights:
            problems.append(f"missing tensor {key!r} (expected shape {list(param.shape)})")
        elif tuple(weights[key].shape) != tuple(param.shape):
            problems.append(f"tensor {key!r} has shape {list(weights[key].shape)}, expected {list(param.shape)}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(f"{source}: {shown}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        log.info("%s: ignoring %d tensor(s) the model does not use (e.g. %s)", source, len(extra), extra[0])

    modules = dict(module.named_modules())
    for key in expected:
        tensor = weights[key]
        owner_name, _, leaf = key.rpartition(".")
        owner = modules[owner_name]
        is_fp8 = tensor.dtype in FLOAT8_DTYPES
        if is_fp8 and isinstance(owner, Linear) and leaf == "weight" and keep_fp8:
            value = tensor.to(device=device)
            scale = scales.get(key)
            owner.weight_scale = scale.to(device=device, dtype=torch.float32) if scale is not None else None
        else:
            if is_fp8:
                tensor = tensor.to(torch.float32)
                scale = scales.get(key)
                if scale is not None:
                    scale = scale.float()
                    tensor = tensor * (scale.reshape(-1, *[1] * (tensor.ndim - 1)) if scale.ndim == 1 else scale)
            value = tensor.to(device=device, dtype=dtype or tensor.dtype)
        setattr(owner, leaf, nn.Parameter(value, requires_grad=False))
