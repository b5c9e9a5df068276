"""Compiled DiT graphs shared by every worker of a cluster: PyTorch's mega-cache in a folder or on S3.

Building a graph with inductor is most of a minute per shape on a GPU (minutes for a whole model);
loading the same graph from inductor's caches is seconds. The caches are per machine
(`TORCHINDUCTOR_CACHE_DIR`), so without this module every autoscaled node, replaced spot node and new
Serve replica builds every graph again. `CompileCache` keeps what torch calls the mega-cache
(`torch.compiler.save_cache_artifacts`: the FX-graph, AOTAutograd, inductor and Triton/autotuning
caches in one blob) where all workers see it:

- **Where**: `ModelSpec.compile_cache` (`--compile-cache`), a local folder or an `s3://` prefix; by
  default `compile/` beside the node's model cache (`storage/model_cache.py`). This module reads and
  writes it through an `ArtifactStore` its caller opens (render_service/loading.py hands the storage backend down
  through the engine): the network layer and the engine stay below storage.
- **Keyed by what makes it valid** (`CompileKey`): torch and Triton versions, the device's name and
  compute capability, the compute dtype, the quantisation and the DiT's block geometry. Each key is a
  folder of artifacts named by the graphs' shape key; a worker loads every artifact of its key before
  it compiles anything, so a graph another worker built is a cache hit, not a build.
- **Published once, atomically**: the first worker to build a graph writes the blob with the storage
  backend's `put_if_absent` (a hard link of a complete temporary file locally, `If-None-Match: *` on
  S3), so two workers racing leave one complete artifact and neither sees a torn file.
- **Kernels too**: torch's mega-cache holds the compiled graphs but not inductor's compiled CPU kernels
  (the C++ `.so` files a graph loads; a hit would run the C++ compiler again, most of the cost on the
  CPU), so the artifact also carries the files this process wrote into the local inductor cache
  (`TORCHINDUCTOR_CACHE_DIR`), unpacked there before the graphs load. Only files written since the cache
  was opened are packed: a graph this process found in its node's own inductor cache goes out without its
  CPU kernels, and a node that loads it compiles their C++ again (still no graph build).
- **Never fatal**: an artifact that is corrupt, or written under another key (a file copied between
  folders by hand), is skipped with one warning and the graphs compile as if there were no cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger(__name__)

# An artifact is this magic line, one JSON line ({"key": the CompileKey it was written under, "megacache":
# the blob's length}), the mega-cache blob, then a tar of the local inductor cache's kernel files.
_MAGIC = b"snapref-ray compile cache v2\n"
# Folders of the local inductor cache that are not kernels: the mega-cache carries the first two, locks are locks.
_NOT_KERNELS = ("fxgraph", "aotautograd", "locks")
ARTIFACT_SUFFIX = ".megacache"


class ArtifactStore(Protocol):
    """Where artifacts are kept: a folder or an s3:// prefix (the storage backends satisfy it). A failure
    raises an OSError, which this module turns into a warning."""

    def list(self, prefix: str) -> list[str]: ...

    def get_bytes(self, key: str) -> bytes: ...

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Write `data` under `key` whole, unless something is there already: whether it was written."""


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


@dataclass(frozen=True)
class CompileKey:
    """What a compiled graph is valid for; graphs built under one key are never loaded under another."""

    torch: str
    triton: str
    device: str  # the device's name ("NVIDIA H100 80GB HBM3", "cpu")
    capability: str  # CUDA compute capability ("9.0"), "" on the CPU
    dtype: str  # the DiT's compute dtype
    quantize: str  # "none" or "fp8"
    model: str  # the block geometry: width, heads x head_dim, context, MLP, adaLN rank

    @classmethod
    def for_dit(cls, dit: torch.nn.Module, quantize: str) -> CompileKey:
        """The key of `dit`'s graphs on the device its weights are on."""
        device = next(dit.parameters()).device
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            major, minor = torch.cuda.get_device_capability(device)
            capability = f"{major}.{minor}"
        else:
            name, capability = device.type, ""
        c = dit.config
        return cls(
            torch=torch.__version__,
            triton=_triton_version(),
            device=name,
            capability=capability,
            dtype=str(dit.compute_dtype).removeprefix("torch."),
            quantize=quantize,
            model=f"D{c.model_channels}-H{c.num_heads}x{c.head_dim}-C{c.context_dim}-M{c.mlp_hidden}-r{c.adaln_lora_dim}",
        )

    @property
    def digest(self) -> str:
        """The folder the key's artifacts live in: a hash of every field (readable ones are in each artifact)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:20]


@dataclass
class CacheLoad:
    """What `CompileCache.load` found: artifacts loaded, and the ones skipped with the reason."""

    loaded: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


class CompileCache:
    """A key's compile artifacts in a folder or under an s3:// prefix (see the module docstring), kept in the
    store `open_store(location)` opens (called on first use)."""

    def __init__(
        self, location: str | os.PathLike, key: CompileKey, *, open_store: Callable[[str], ArtifactStore]
    ) -> None:
        self.location = os.fspath(location)
        self.key = key
        self._open_store = open_store
        self._storage: ArtifactStore | None = None
        self.published: list[str] = []
        # Inductor/AOTAutograd artifact ids the shared cache is known to hold (loaded or published here):
        # a process publishes only when it holds one that is not among them.
        self.known: set[str] = set()
        # Kernel files written into the local inductor cache after this moment are this process's to publish.
        self._since = time.time()

    @property
    def storage(self) -> ArtifactStore:
        if self._storage is None:  # opened on first use: a worker that never compiles never touches it
            self._storage = self._open_store(self.location)
        return self._storage

    def artifact_key(self, shape_key: str) -> str:
        return f"{self.key.digest}/{shape_key}{ARTIFACT_SUFFIX}"

    def load(self) -> CacheLoad:
        """Load every artifact of this key into the process's inductor caches (before compiling anything).

        Unreadable, corrupt or mismatched artifacts are skipped; all of them are named in one warning.
        """
        result = CacheLoad()
        try:
            names = [k for k in self.storage.list(f"{self.key.digest}/") if k.endswith(ARTIFACT_SUFFIX)]
        except OSError as e:  # the store's failures (StorageError is one)
            log.warning("compile cache %s: cannot list it (%s); compiling without it", self.location, e)
            return result
        for name in names:
            try:
                blob, kernels = self._unpack(name, self.storage.get_bytes(name))
                _extract_kernels(kernels)
                with _torch_deserialize_warning() as torch_said:
                    info = torch.compiler.load_cache_artifacts(blob)
                if info is None:
                    raise ValueError(
                        "torch could not deserialize the artifacts (corrupt or another torch)"
                        + (f": {torch_said[0]}" if torch_said else "")
                    )
                self.known |= _artifact_ids(info)
            except Exception as e:  # a cache must never stop a worker: anything wrong means "compile"
                result.skipped[name] = f"{type(e).__name__}: {e}"
                continue
            result.loaded.append(name)
        if result.skipped:
            log.warning(
                "compile cache %s: ignored %d artifact(s), their graphs will compile: %s",
                self.location,
                len(result.skipped),
                "; ".join(f"{k}: {why}" for k, why in result.skipped.items()),
            )
        if result.loaded:
            log.info("compile cache %s: loaded %d artifact(s) for %s", self.location, len(result.loaded), self.key)
        return result

    def publish(self, shape_key: str) -> bool:
        """Write what this process compiled so far under `shape_key`, if the cache lacks any of it.

        False when there is nothing new or another worker published that name first (its artifact is as
        good: the same graphs). Never raises for a storage failure (a worker whose cache is read-only
        still renders): it warns.
        """
        blob, info = torch.compiler.save_cache_artifacts() or (b"", None)
        ids = _artifact_ids(info)
        if not blob or ids <= self.known:
            return False
        self.known |= ids
        name = self.artifact_key(shape_key)
        header = json.dumps({"key": asdict(self.key), "megacache": len(blob)}, sort_keys=True).encode() + b"\n"
        try:
            written = self.storage.put_if_absent(name, _MAGIC + header + blob + _pack_kernels(self._since))
        except OSError as e:  # the store's failures (StorageError is one)
            log.warning("compile cache %s: could not publish %s (%s)", self.location, name, e)
            return False
        if written:
            self.published.append(name)
            log.info("compile cache %s: published %s (%.1f MB)", self.location, name, len(blob) / 1e6)
        return written

    def _unpack(self, name: str, data: bytes) -> tuple[bytes, bytes]:
        if not data.startswith(_MAGIC):
            raise ValueError("not a snapref-ray compile artifact of this version (no header)")
        header, sep, rest = data[len(_MAGIC) :].partition(b"\n")
        if not sep:
            raise ValueError("truncated header")
        fields = json.loads(header)
        written_for, size = fields["key"], fields["megacache"]
        if len(rest) < size:
            raise ValueError(f"truncated: {len(rest)} bytes after the header, the mega-cache alone is {size}")
        expected = asdict(self.key)
        if written_for != expected:
            diff = {k: (written_for.get(k), v) for k, v in expected.items() if written_for.get(k) != v}
            raise ValueError(f"written for another key (found, expected): {diff}")
        return rest[:size], rest[size:]


# torch logs this WARNING, with a traceback, for a mega-cache blob it cannot read, then returns None; `load` names
# the artifact and torch's reason in its own one warning instead.
_TORCH_CACHE_LOGGER = "torch.compiler._cache"
_TORCH_DESERIALIZE_FAILED = "Failed to un-pickle cache artifacts"


@contextlib.contextmanager
def _torch_deserialize_warning() -> Iterator[list[str]]:
    """Within the block, torch's "Failed to un-pickle cache artifacts" warning is kept off every handler (the user,
    the log) and its exception, as one line, appended to the list yielded."""
    said: list[str] = []

    def keep(record: logging.LogRecord) -> bool:
        if record.getMessage() != _TORCH_DESERIALIZE_FAILED:
            return True
        error = record.exc_info[1] if record.exc_info else None
        said.append(f"{type(error).__name__}: {error}" if error is not None else _TORCH_DESERIALIZE_FAILED)
        return False

    logger = logging.getLogger(_TORCH_CACHE_LOGGER)
    logger.addFilter(keep)
    try:
        yield said
    finally:
        logger.removeFilter(keep)


def _inductor_cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def _pack_kernels(since: float) -> bytes:
    """A tar of the kernel files written into the local inductor cache since `since` (paths relative to it)."""
    root = _inductor_cache_dir()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        for dirpath, dirs, files in os.walk(root):
            if Path(dirpath) == root:
                dirs[:] = [d for d in dirs if d not in _NOT_KERNELS]
            for name in sorted(files):
                path = Path(dirpath) / name
                if path.stat().st_mtime >= since:
                    tar.add(path, arcname=path.relative_to(root).as_posix(), recursive=False)
    return buffer.getvalue()


def _extract_kernels(data: bytes) -> None:
    """Write the packed kernel files into the local inductor cache, each complete (temp + rename), never
    over a file that is there, and never outside the cache folder."""
    if not data:
        return
    root = _inductor_cache_dir().resolve()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            target = (root / member.name).resolve()
            if not member.isfile() or root not in target.parents:
                raise ValueError(f"kernel archive entry {member.name!r} is not a file inside the inductor cache")
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
            tmp.write_bytes(tar.extractfile(member).read())
            os.chmod(tmp, member.mode & 0o777 or 0o644)
            os.replace(tmp, target)


def _artifact_ids(info) -> set[str]:
    """The artifact ids of a mega-cache `CacheInfo` ("inductor:<key>", "aot_autograd:<key>", ...)."""
    if info is None:
        return set()
    return {f"{kind}:{key}" for kind, keys in info.artifacts.items() for key in keys}


__all__ = ["ArtifactStore", "CacheLoad", "CompileCache", "CompileKey"]
