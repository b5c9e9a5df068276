"""A safetensors file's header, read and checked without torch: tensor names, dtypes, shapes and byte ranges.

The driver plans a job from headers alone (the model's shape, a worker's memory, an adapter's kind), so this
module and what it serves import no torch; `checkpoint.py` loads the tensors themselves.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

V = TypeVar("V")

# Key prefixes a diffusion-model file may carry (diffusion-pipe `net.`, full ComfyUI checkpoints
# `model.diffusion_model.`, ComfyUI LoRA-style `diffusion_model.`).
DIT_PREFIXES = ("net.", "model.diffusion_model.", "diffusion_model.")
# Names used next to a float8 weight for its dequantisation scale.
SCALE_SUFFIXES = ("weight_scale", "scale_weight")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


def read_header(path: str | os.PathLike) -> tuple[dict, dict[str, str]]:
    """Validate a safetensors file's framing; return (tensor entries, __metadata__)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, too short for a header)")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > min(size - 8, 100 * 2**20):
            raise CheckpointError(
                f"{path}: not a safetensors file (header length {header_len} does not fit a {size}-byte file;"
                " a pickle .ckpt/.pt file, or a truncated download?)"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    data_len = size - 8 - header_len
    for key, entry in header.items():
        try:
            start, end = entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor {key!r}") from None
        if end > data_len or start > end:
            raise CheckpointError(
                f"{path}: file is truncated: tensor {key!r} ends at byte {end} of the data section,"
                f" which holds only {data_len} bytes"
            )
    return header, metadata


def strip_prefix(sd: Mapping[str, V], prefixes: tuple[str, ...] = DIT_PREFIXES) -> dict[str, V]:
    """Remove the first known prefix that at least half the keys carry; other keys are kept as they are."""
    for prefix in prefixes:
        n = sum(1 for k in sd if k.startswith(prefix))
        if n and n >= len(sd) // 2:
            return {(k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in sd.items()}
    return dict(sd)
