"""`snapref-ray adapter convert IN OUT --map MAP.yaml`: rename the tensors of a file whose names differ.

The real ArcAnima (and SnapRef) tensor names are not known here; when a real file spells them
differently from what the loaders read, a small map fixes it instead of a second code path:

```yaml
rename:                    # applied in order to every tensor name (Python regular expressions)
  - ["^ref_adapter\\.", "diffusion_model."]
  - ["\\.down$", ".lora_down.weight"]
drop: ["^optimizer\\."]    # tensors to leave out (optional)
kind: arcanima-v2          # stamp `adapter_kind` metadata (optional; also `lora` for a plain LoRA)
metadata: {note: "..."}    # more metadata to set (optional)
```

The output is written next to OUT and renamed into place; it is then detected like any file,
and a `kind:` the result does not satisfy is an error (the output is removed).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from snapref_ray.adapter.file import AdapterError
from snapref_ray.adapter.kinds import ARCANIMA_KINDS, KIND_METADATA_KEY, Detection, detect_kind
from snapref_ray.models.safetensors_header import CheckpointError, read_header

MAP_KEYS = {"rename", "drop", "kind", "metadata"}


def load_map(path: str | os.PathLike) -> dict:
    """Read and check a rename map; errors name the map file and the entry."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise AdapterError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{path}: a map is a YAML mapping with keys {sorted(MAP_KEYS)}")
    unknown = set(data) - MAP_KEYS
    if unknown:
        raise AdapterError(f"{path}: unknown key(s) {sorted(unknown)}; a map has {sorted(MAP_KEYS)}")
    rules = []
    for i, rule in enumerate(data.get("rename") or []):
        if not (isinstance(rule, list) and len(rule) == 2 and all(isinstance(x, str) for x in rule)):
            raise AdapterError(f"{path}: rename[{i}] must be [PATTERN, REPLACEMENT], found {rule!r}")
        try:
            rules.append((re.compile(rule[0]), rule[1]))
        except re.error as e:
            raise AdapterError(f"{path}: rename[{i}] pattern {rule[0]!r}: {e}") from None
    drops = []
    for i, pattern in enumerate(data.get("drop") or []):
        try:
            drops.append(re.compile(str(pattern)))
        except re.error as e:
            raise AdapterError(f"{path}: drop[{i}] pattern {pattern!r}: {e}") from None
    kind = data.get("kind")
    if kind is not None and kind not in (*ARCANIMA_KINDS, "lora"):
        raise AdapterError(
            f"{path}: kind {kind!r} is not one of {', '.join((*ARCANIMA_KINDS, 'lora'))}"
            " (SnapRef files carry their own format metadata)"
        )
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise AdapterError(f"{path}: metadata must be a mapping of strings")
    return {"rename": rules, "drop": drops, "kind": kind, "metadata": {str(k): str(v) for k, v in metadata.items()}}


def rename_keys(keys: list[str], rules: list, drops: list) -> dict[str, str]:
    """old name -> new name for the kept tensors; two tensors landing on one name is an error."""
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for key in keys:
        if any(p.search(key) for p in drops):
            continue
        new = key
        for pattern, replacement in rules:
            new = pattern.sub(replacement, new)
        if new in seen:
            raise AdapterError(f"tensors {seen[new]!r} and {key!r} would both be named {new!r}")
        seen[new] = key
        out[key] = new
    return out


def convert(src: str | os.PathLike, dst: str | os.PathLike, map_path: str | os.PathLike) -> Detection:
    """Write `src` with renamed tensors (and metadata) to `dst`; returns what `dst` is detected as."""
    spec = load_map(map_path)
    src, dst = Path(src), Path(dst)
    try:
        _, metadata = read_header(src)
    except CheckpointError as e:
        raise AdapterError(str(e)) from None
    with safe_open(str(src), framework="pt") as f:
        names = rename_keys(list(f.keys()), spec["rename"], spec["drop"])
        tensors = {new: f.get_tensor(old).contiguous() for old, new in names.items()}
    if not tensors:
        raise AdapterError(f"{map_path}: the map drops every tensor of {src}")
    metadata = {**metadata, **spec["metadata"]}
    if spec["kind"] is not None:
        metadata[KIND_METADATA_KEY] = spec["kind"]
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata or None)
        detection = detect_kind(tmp)
        if spec["kind"] is not None and detection.kind != spec["kind"]:
            raise AdapterError(
                f"{dst}: the map says kind {spec['kind']!r}, but the converted file is"
                f" {detection.kind}: {detection.reason}"
            )
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return Detection(str(dst), detection.kind, detection.how, detection.reason, detection.metadata, detection.signature)
