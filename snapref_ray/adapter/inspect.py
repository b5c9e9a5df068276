"""`snapref-ray adapter inspect FILE`: what an adapter file holds, from its header and mode vectors.

Inspection validates the file exactly as `load_adapter` does (an invalid file raises the same
AdapterError) but reads only the header, the tiny mode vectors and, for the identity, the bytes
of the file; no LoRA tensor is materialised.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import safe_open

from snapref_ray.adapter.file import (
    FORMAT, REF_LINEARS, TARGET_LINEARS, AdapterError, adapter_identity, check_adapter_file, mode_key,
)


def inspect_adapter(path: str | os.PathLike) -> dict:
    """A JSON-serialisable summary of a valid `anima_ref_kv/1` file (raises AdapterError otherwise)."""
    path = Path(path)
    meta, layout = check_adapter_file(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            mode_weights = {m: [round(float(v), 6) for v in f.get_tensor(mode_key(m)).float().tolist()]
                            for m in meta.modes}
    except Exception as e:  # safetensors' own error types; the header was valid, so the data is damaged
        raise AdapterError(f"{path}: cannot read the mode vectors: {e}") from None
    return {
        "path": str(path),
        "file_size": path.stat().st_size,
        "format": FORMAT,
        "base_model": meta.base_model,
        "num_blocks": meta.num_blocks,
        "model_channels": meta.model_channels,
        "context_dim": layout.context_dim,
        "mlp_hidden": layout.mlp_hidden,
        "ref_rank": meta.ref_rank,
        "target_rank": meta.target_rank,
        "ref_alpha": meta.ref_alpha,
        "target_alpha": meta.target_alpha,
        "ref_scale": meta.ref_scale,
        "target_scale": meta.target_scale,
        "ref_linears": list(REF_LINEARS),
        "target_linears": list(TARGET_LINEARS),
        "ref_rope_offset": list(meta.ref_rope_offset),
        "modes": list(meta.modes),
        "mode_weights": mode_weights,
        "num_parameters": layout.num_parameters,
        "weight_format": meta.weight_format,
        "tensor_dtypes": list(layout.tensor_dtypes),
        "num_tensors": layout.num_tensors,
        "identity": adapter_identity(path),
    }


def format_inspection(info: dict) -> str:
    """Human-readable lines for an `inspect_adapter` result."""
    def vector(values: list[float]) -> str:
        if len(set(values)) == 1:
            return f"all {values[0]:g} ({len(values)} blocks)"
        return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"

    rows = [
        ("file", f"{info['path']} ({_size(info['file_size'])})"),
        ("format", info["format"]),
        ("base model", info["base_model"]),
        ("blocks", f"{info['num_blocks']} (model channels {info['model_channels']},"
                   f" cross-attn context {info['context_dim']}, MLP hidden {info['mlp_hidden']})"),
        ("reference LoRA", f"rank {info['ref_rank']}, alpha {info['ref_alpha']:g} (scale {info['ref_scale']:g}),"
                           f" {len(info['ref_linears'])} linears per block"),
        ("target LoRA", f"rank {info['target_rank']}, alpha {info['target_alpha']:g}"
                        f" (scale {info['target_scale']:g}), {', '.join(info['target_linears'])}"),
        ("parameters", f"{info['num_parameters']:,} ({_count(info['num_parameters'])})"),
        ("weights", f"{info['weight_format']} (tensor dtypes: {', '.join(info['tensor_dtypes'])};"
                    f" {info['num_tensors']} tensors)"),
        ("reference RoPE offset", json.dumps(info["ref_rope_offset"])),
    ]
    rows += [(f"mode {mode}", vector(info["mode_weights"][mode])) for mode in info["modes"]]
    rows.append(("identity", info["identity"]))
    width = max(len(label) for label, _ in rows) + 1
    return "\n".join(f"{label + ':':<{width}} {value}" for label, value in rows)


def _size(nbytes: int) -> str:
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:.2f} GB"
    if nbytes >= 1e6:
        return f"{nbytes / 1e6:.1f} MB"
    if nbytes >= 1e3:
        return f"{nbytes / 1e3:.1f} kB"
    return f"{nbytes} bytes"


def _count(n: int) -> str:
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)
