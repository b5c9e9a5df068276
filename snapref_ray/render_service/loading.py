"""A `ModelSpec` -> a loaded `Renderer`, with s3:// files fetched once per node: the one model loader.

Batch workers, Serve replicas, Ray Data actors and the command line all load through `load_renderer`.
s3:// model folders and files go through the per-node model cache (storage/model_cache.py: each object
downloaded once per node, however many processes start there). A compiled model shares its graphs through
the spec's compile cache (models/compile_cache.py; by default `compile/` beside the model cache).
`adapter_kind` reads only the adapter file's header, so a job's driver can resolve settings for the adapter
kind before any worker exists.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from snapref_ray.adapter.kinds import detect_kind
from snapref_ray.model_spec import MODEL_FILE_FIELDS, ModelSpec
from snapref_ray.models.bundle import ADAPTER_PATTERNS
from snapref_ray.models.lora_keys import group_lora_keys
from snapref_ray.models.safetensors_header import read_header
from snapref_ray.storage.backends import S3Options, S3Storage, StorageError, open_storage, split_s3_uri
from snapref_ray.storage.model_cache import default_compile_cache_dir, ensure_local, ensure_local_folder
from snapref_ray.uris import is_remote

if TYPE_CHECKING:  # the engine (torch) is imported where a model loads, not by a driver asking a file's kind
    from snapref_ray.engine import Renderer

log = logging.getLogger(__name__)

_FOLDER_FIELDS = ("qwen_tokenizer", "t5_tokenizer")


def localise(spec: ModelSpec, *, s3: S3Options | None = None, cache_dir: str | None = None) -> ModelSpec:
    """The spec with every s3:// folder and file replaced by its node-local cached copy."""
    if not spec.is_remote():
        return spec

    def local(uri: str | None, folder: bool = False) -> str | None:
        if uri is None or not is_remote(uri):
            return uri
        fetch = ensure_local_folder if folder else ensure_local
        return os.fspath(fetch(uri, cache_dir, s3))

    return spec.model_copy(
        update={
            "models_dir": local(spec.models_dir, folder=True),
            "adapter": local(spec.adapter),
            **{name: local(getattr(spec, name), folder=name in _FOLDER_FIELDS) for name in MODEL_FILE_FIELDS},
            "loras": tuple(lora.model_copy(update={"path": local(lora.path)}) for lora in spec.loras),
        }
    )


def load_renderer(spec: ModelSpec, *, s3: S3Options | None = None, cache_dir: str | None = None) -> Renderer:
    """The Renderer `spec` describes, on its device (s3:// files fetched into the node's model cache)."""
    import torch

    from snapref_ray.engine import Renderer

    local = localise(spec, s3=s3, cache_dir=cache_dir)
    files = local.local_files()
    return Renderer(
        files,
        adapter=files.adapter,
        loras=[(lora.path, lora.strength) for lora in local.loras],
        device=None if spec.device == "auto" else spec.device,
        dtype=None if spec.dtype == "auto" else getattr(torch, spec.dtype),
        compile=spec.compile,
        quantize=None if spec.quantize == "none" else spec.quantize,
        compile_cache=compile_cache_location(spec, cache_dir) if spec.compile else None,
        open_compile_store=lambda location: open_storage(location, s3),
    )


def compile_cache_location(spec: ModelSpec, cache_dir: str | None = None) -> str:
    """Where `spec`'s compiled graphs are shared: its `compile_cache`, else `compile/` beside the model cache."""
    if spec.compile_cache is not None:
        return spec.compile_cache
    if cache_dir is not None:
        return os.fspath(Path(cache_dir).expanduser().parent / "compile")
    return os.fspath(default_compile_cache_dir())


def adapter_file(spec: ModelSpec, *, s3: S3Options | None = None, cache_dir: str | None = None) -> Path | None:
    """The local path of the spec's reference adapter (the explicit one, else the models folder's), or None.

    For an s3:// models folder only the adapter file is fetched, not the whole folder.
    """
    if spec.adapter is not None:
        return ensure_local(spec.adapter, cache_dir, s3)
    if spec.models_dir is None:
        return None
    if not is_remote(spec.models_dir):
        return spec.local_files().adapter
    root = spec.models_dir.rstrip("/")
    keys = S3Storage(root, s3).list("")
    for pattern in ADAPTER_PATTERNS:
        hits = sorted(key for key in keys if fnmatch.fnmatch(key, pattern))
        if hits:
            return ensure_local(f"{root}/{hits[0]}", cache_dir, s3)
    return None


def check_named_files(spec: ModelSpec, *, s3: S3Options | None = None) -> None:
    """Every LoRA and explicit model file the spec names exists (local: on disk; s3://: by one HEAD, nothing is
    downloaded), else a `StorageError` naming it, and a local LoRA's keys are a LoRA's (`LoRAError`, the engine's own
    message): what a driver or the server can know before any worker starts, where each worker would fail to load
    it (and the pool give up after four, in tracebacks)."""
    named = [(f"LoRA file {lora.path}", lora.path) for lora in spec.loras]
    named += [(f"model file {getattr(spec, f)}", getattr(spec, f)) for f in MODEL_FILE_FIELDS if getattr(spec, f)]
    for what, path in named:
        if is_remote(path) and any(getattr(spec, f) == path for f in _FOLDER_FIELDS):
            continue  # an s3:// tokenizer folder: listed where it is fetched
        if is_remote(path):
            bucket, key = split_s3_uri(path)
            found = S3Storage(f"s3://{bucket}", s3).head(key) is not None
        else:
            found = Path(path.removeprefix("file://")).expanduser().exists()
        if not found:
            raise StorageError(f"{what} does not exist")
    for lora in spec.loras:  # a local LoRA's keys, from its header: what the engine would refuse in every worker
        if not is_remote(lora.path):
            header, _ = read_header(Path(lora.path.removeprefix("file://")).expanduser())
            group_lora_keys(header, f"LoRA file {lora.path}")


def adapter_kind(spec: ModelSpec, *, s3: S3Options | None = None, cache_dir: str | None = None) -> str | None:
    """ "snapref", "arcanima-v2", "arcanima-pilot", or None without an adapter; from the file's header.

    A file that is not a reference adapter (a plain LoRA, an unreadable file) is the engine's error to
    raise when a worker loads it; here it counts as no kind (SnapRef's defaults resolve the settings).
    """
    path = adapter_file(spec, s3=s3, cache_dir=cache_dir)
    if path is None:
        return None
    detection = detect_kind(path)
    return detection.kind if detection.is_adapter else None
