"""`snapref-ray adapter inspect FILE`: what a file is (any kind, also one it cannot use) and what it holds.

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
    FORMAT,
    REF_LINEARS,
    TARGET_LINEARS,
    AdapterError,
    adapter_identity,
    check_adapter_file,
    mode_key,
)


def inspect_adapter(path: str | os.PathLike) -> dict:
    """A JSON-serialisable summary of a valid `anima_ref_kv/1` file (raises AdapterError otherwise)."""
    path = Path(path)
    meta, layout = check_adapter_file(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            mode_weights = {
                m: [round(float(v), 6) for v in f.get_tensor(mode_key(m)).float().tolist()] for m in meta.modes
            }
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
        (
            "blocks",
            f"{info['num_blocks']} (model channels {info['model_channels']},"
            f" cross-attn context {info['context_dim']}, MLP hidden {info['mlp_hidden']})",
        ),
        (
            "reference LoRA",
            f"rank {info['ref_rank']}, alpha {info['ref_alpha']:g} (scale {info['ref_scale']:g}),"
            f" {len(info['ref_linears'])} linears per block",
        ),
        (
            "target LoRA",
            f"rank {info['target_rank']}, alpha {info['target_alpha']:g}"
            f" (scale {info['target_scale']:g}), {', '.join(info['target_linears'])}",
        ),
        ("parameters", f"{info['num_parameters']:,} ({_count(info['num_parameters'])})"),
        (
            "weights",
            f"{info['weight_format']} (tensor dtypes: {', '.join(info['tensor_dtypes'])};"
            f" {info['num_tensors']} tensors)",
        ),
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


# ---------------------------------------------------------------------------------------------
# Any file: what it is and why (snapref-ray adapter inspect)


def inspect_file(path: str | os.PathLike) -> dict:
    """What any file is: a SnapRef or ArcAnima adapter, a plain LoRA, or something unusable, and why.

    Never raises for a file it cannot use: `kind` is then "unusable" and `reason` says why.
    """
    from snapref_ray.adapter.kinds import ARCANIMA_LAYOUTS, detect_kind

    path = Path(path)
    detection = detect_kind(path)
    info: dict = {
        "path": str(path),
        "kind": detection.kind,
        "is_adapter": detection.is_adapter,
        "detected_by": detection.how,
        "reason": detection.reason,
        "file_size": path.stat().st_size if path.is_file() else None,
    }
    if detection.kind == "snapref":
        try:
            info["snapref"] = inspect_adapter(path)
            info["method"] = (
                "SnapRef: reference stream once at timestep 0 with the reference LoRA (rank"
                f" {info['snapref']['ref_rank']}), K/V cached per block; target LoRA on q_proj"
            )
        except AdapterError as e:
            info.update(kind="unusable", is_adapter=False, reason=str(e))
        return info
    sig = detection.signature
    if sig is not None:
        info.update(
            key_style=sig.key_style,
            rank="/".join(map(str, sig.ranks)),
            num_blocks=len(sig.blocks),
            linears=list(sig.linears),
            other_modules=list(sig.other_modules),
            dtypes=list(sig.dtypes),
            num_parameters=sig.num_parameters,
            has_alpha=sig.has_alpha,
        )
    if detection.kind in ARCANIMA_LAYOUTS:
        layout = ARCANIMA_LAYOUTS[detection.kind]
        info.update(
            method=layout.method,
            published_file=layout.published_file,
            published_rank=layout.rank,
            published_blocks=layout.num_blocks,
            lora_in_reference_stream=layout.lora_in_reference_stream,
            identity=adapter_identity(path),
        )
    elif detection.kind == "lora":
        info["method"] = "none: a plain LoRA is merged into the model with --lora; it reads no reference"
    return info


def format_file_inspection(info: dict) -> str:
    """Human-readable lines for an `inspect_file` result."""
    if info["kind"] == "snapref" and "snapref" in info:
        head = [
            ("kind", f"snapref (SnapRef {FORMAT} adapter; detected by {info['detected_by']})"),
            ("why", info["reason"]),
            ("method", info["method"]),
        ]
        width = max(len(label) for label, _ in head) + 1
        return (
            "\n".join(f"{label + ':':<{width}} {value}" for label, value in head)
            + "\n"
            + format_inspection(info["snapref"])
        )
    what = {
        "arcanima-v2": "ArcAnima Reference Adapter v2",
        "arcanima-pilot": "ArcAnima Reference Adapter pilot",
        "lora": "a plain LoRA, NOT a reference adapter",
        "unusable": "not usable here",
    }[info["kind"]]
    rows = [
        ("file", f"{info['path']}" + (f" ({_size(info['file_size'])})" if info.get("file_size") else "")),
        ("kind", f"{info['kind']} ({what})"),
        ("detected by", info["detected_by"]),
        ("why", info["reason"]),
    ]
    if "rank" in info:
        rows += [
            (
                "LoRA",
                f"rank {info['rank']}, {info['num_blocks']} blocks, {len(info['linears'])} linears per"
                f" block ({', '.join(info['linears'])})"
                + (f"; plus {len(info['other_modules'])} other module(s)" if info["other_modules"] else ""),
            ),
            ("keys", f"{info['key_style']} spelling" + (", with alpha" if info["has_alpha"] else ", no alpha")),
            ("dtype", ", ".join(info["dtypes"])),
            ("parameters", f"{info['num_parameters']:,} ({_count(info['num_parameters'])})"),
        ]
    if "method" in info:
        rows.append(("method", info["method"]))
    if "published_file" in info:
        rows.append(
            ("published", f"{info['published_file']}: rank {info['published_rank']}, {info['published_blocks']} blocks")
        )
        rows.append(
            (
                "LoRA in reference stream",
                "yes" if info["lora_in_reference_stream"] else "no (documented choice, docs/adapters.md)",
            )
        )
        rows.append(("identity", info["identity"]))
    width = max(len(label) for label, _ in rows) + 1
    return "\n".join(f"{label + ':':<{width}} {value}" for label, value in rows)
