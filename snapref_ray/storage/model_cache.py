"""Model files from s3:// into a per-node cache, downloaded once however many workers start at once.

Several GPU workers on a node start together and all ask for the same multi-GB checkpoint. One of
them takes an exclusive ``fcntl`` lock beside the cache entry and downloads to a temporary file that
is renamed into place when complete and the right size; the others wait on the lock and then find the
file. A crash mid-download leaves only a temporary file, never a truncated checkpoint under the real
name (the lock dies with its process).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path

from .backends import S3Options, S3Storage, StorageError, split_s3_uri

log = logging.getLogger(__name__)

CACHE_ENV = "SNAPREF_RAY_CACHE"


def default_cache_dir() -> Path:
    """``$SNAPREF_RAY_CACHE`` or ``~/.cache/snapref-ray/models``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "snapref-ray" / "models"


def default_compile_cache_dir() -> Path:
    """Where compiled graphs are shared by default (models/compile_cache.py): `compile/` beside the node's model
    cache (`$SNAPREF_RAY_CACHE/../compile`, else ~/.cache/snapref-ray/compile)."""
    return default_cache_dir().parent / "compile"


def cache_path(uri: str, cache_dir: str | Path | None = None) -> Path:
    """Where s3:// `uri` is cached: ``<cache_dir>/<sha256(uri)[:24]>/<file name>``.

    The hash keeps two objects of the same name apart; the file name is kept for people and loaders.
    """
    _bucket, key = split_s3_uri(uri)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / hashlib.sha256(uri.encode()).hexdigest()[:24] / key.rsplit("/", 1)[-1]


def _stamp_path(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.source.json")


def _read_stamp(dest: Path) -> dict | None:
    try:
        return json.loads(_stamp_path(dest).read_text())
    except (OSError, ValueError):
        return None


def _is_current(dest: Path, size: int, etag: str | None) -> bool:
    if not dest.is_file() or dest.stat().st_size != size:
        return False
    # Same size is not proof of the same file (a re-uploaded checkpoint of equal size); the ETag is.
    stamp = _read_stamp(dest)
    return stamp is not None and stamp.get("etag") == etag and stamp.get("size") == size


def _download(store: S3Storage, key: str, tmp: Path) -> None:
    store.download_file(key, tmp)


def ensure_local(uri: str, cache_dir: str | Path | None = None, s3: S3Options | None = None) -> Path:
    """A local path for `uri`: local paths are returned as they are, s3:// objects are cached on this node.

    The cache entry is `cache_path` (cache_dir defaults to `default_cache_dir`). An entry is reused
    when its size equals the object's ContentLength and its recorded ETag matches; otherwise it is
    downloaded again. Safe when several processes call it at
    once for the same uri: one downloads, the others wait and reuse.
    """
    if not uri.startswith("s3://"):
        path = Path(uri.removeprefix("file://")).expanduser()
        if not path.exists():
            raise StorageError(f"model file {path} does not exist")
        return path
    bucket, key = split_s3_uri(uri)
    store = S3Storage(f"s3://{bucket}", s3)
    dest = cache_path(uri, cache_dir)
    try:
        head = store.head(key)
    except StorageError as e:
        # The store is unreachable (past outage_tolerance_s): a complete earlier download still
        # lets a worker start, which beats failing a node that already holds the weights.
        stamp = _read_stamp(dest)
        if stamp and dest.is_file() and dest.stat().st_size == stamp.get("size"):
            log.warning("cannot check %s (%s); using the cached copy %s", uri, e, dest)
            return dest
        raise
    if head is None:
        raise StorageError(f"model file {uri} does not exist")
    size, etag = int(head["ContentLength"]), head.get("ETag")
    if _is_current(dest, size, etag):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
        try:
            if _is_current(dest, size, etag):  # another process finished it while we waited
                return dest
            tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}")
            log.info("downloading %s (%.1f MB) to %s", uri, size / 1e6, dest)
            try:
                _download(store, key, tmp)
                got = tmp.stat().st_size
                if got != size:
                    raise StorageError(f"download of {uri} is {got} bytes, expected ContentLength {size}")
                os.replace(tmp, dest)
            finally:
                tmp.unlink(missing_ok=True)
            _stamp_path(dest).write_text(json.dumps({"uri": uri, "size": size, "etag": etag}))
            return dest
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_local_folder(uri: str, cache_dir: str | Path | None = None, s3: S3Options | None = None) -> Path:
    """A local folder for `uri`: local folders as they are; an s3:// prefix mirrored on this node.

    Each object is fetched once per node through `ensure_local` (same locking and reuse), and the
    folder is a tree of symlinks to those cached files, so a models folder keeps its layout
    (tokenizers/qwen/vocab.json, ...) for the loaders.
    """
    if not uri.startswith("s3://"):
        path = Path(uri.removeprefix("file://")).expanduser()
        if not path.is_dir():
            raise StorageError(f"model folder {path} does not exist")
        return path
    root = uri.rstrip("/")
    if "/" not in root.removeprefix("s3://"):
        raise StorageError(f"model folder {uri}: give a prefix inside the bucket (s3://bucket/models/anima)")
    store = S3Storage(root, s3)
    keys = store.list("")
    if not keys:
        raise StorageError(f"model folder {uri} is empty or does not exist")
    folder = cache_path(root, cache_dir).parent / "tree"
    for key in keys:
        cached = ensure_local(f"{root}/{key}", cache_dir, s3)
        link = folder / key
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() and Path(os.readlink(link)) == cached:
            continue
        tmp = link.with_name(f".{link.name}.link-{os.getpid()}")
        tmp.unlink(missing_ok=True)
        os.symlink(cached, tmp)
        os.replace(tmp, link)
    return folder
