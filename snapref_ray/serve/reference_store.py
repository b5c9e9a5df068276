"""Where uploaded reference files live so that any renderer replica can encode them.

Design: a small Serve deployment, `ReferenceStore`, in front of two layers:

- `DurableReferences` (when `references_uri` is set): a local folder or s3://bucket/prefix,
  content-addressed — `files/<sha256 of the file>` and `references/<reference_id>.json` (the
  ReferenceInfo). Every write is put-if-absent: an id is a hash of what it names, so two
  replicas writing the same id write the same bytes. This is the source of truth: a restarted
  store, ingress or renderer finds old ids there without a re-upload, and any number of store
  replicas can share it.
- `ReferenceLRU`: the files in memory, bounded in bytes, keyed by content hash, plus the ids that
  point at each. With durable storage it is only a cache; without it, it is all there is (one
  replica, and a restart or an eviction answers 404 until the client uploads again).

Why not on the ingress: there may be several ingress replicas, and the replica that encodes a
reference is chosen by the router, not by who received the upload. Why not the object store: an
object `ray.put` by the ingress dies with it, and pinning thousands of refs from a driver-less
process has no natural owner or eviction.
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict

from ray import serve

from snapref_ray.serve.api import ReferenceInfo
from snapref_ray.serve.errors import ApiError
from snapref_ray.storage.backends import S3Options, StorageError, open_storage

_REFERENCE_ID = re.compile(r"[0-9a-f]{32}")  # reference_id_for: 32 hex digits
_CONTENT_HASH = re.compile(r"[0-9a-f]{64}")  # sha256 of the file


class DurableReferences:
    """Reference files and infos under a storage root (a folder or s3:// prefix), content-addressed.

    Blocking I/O: call from a worker thread. Only well-formed ids and hashes become keys, so a
    client's `reference_id` can never name another path in the store.
    """

    def __init__(self, uri: str, s3: S3Options | None = None) -> None:
        self.uri = uri
        self._storage = open_storage(uri, s3)

    def put(self, info: ReferenceInfo, data: bytes) -> None:
        self._storage.put_if_absent(f"files/{info.content_hash}", data)
        # The info last: an id that can be found always has its file.
        self._storage.put_if_absent(f"references/{info.reference_id}.json", info.model_dump_json().encode())

    def info(self, reference_id: str) -> ReferenceInfo | None:
        if not _REFERENCE_ID.fullmatch(reference_id):
            return None
        key = f"references/{reference_id}.json"
        if not self._storage.exists(key):
            return None
        return ReferenceInfo.model_validate_json(self._storage.get_bytes(key))

    def file(self, content_hash: str) -> bytes | None:
        if not _CONTENT_HASH.fullmatch(content_hash):
            return None
        key = f"files/{content_hash}"
        return self._storage.get_bytes(key) if self._storage.exists(key) else None


class ReferenceLRU:
    """Files by content hash (LRU, at most `max_bytes` in all) and the reference ids that use them."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._files: OrderedDict[str, bytes] = OrderedDict()
        self._infos: dict[str, ReferenceInfo] = {}
        self._ids_of_file: dict[str, set[str]] = {}
        self.nbytes = 0
        self.evictions = 0

    def put(self, info: ReferenceInfo, data: bytes) -> ReferenceInfo:
        if len(data) > self.max_bytes:
            raise ValueError(f"a {len(data)}-byte reference exceeds the store's {self.max_bytes} bytes")
        if info.content_hash not in self._files:
            self._files[info.content_hash] = data
            self.nbytes += len(data)
        self._files.move_to_end(info.content_hash)
        self._infos[info.reference_id] = info
        self._ids_of_file.setdefault(info.content_hash, set()).add(info.reference_id)
        while self.nbytes > self.max_bytes:
            self._evict_oldest()
        return info

    def _evict_oldest(self) -> None:
        content_hash, data = self._files.popitem(last=False)
        self.nbytes -= len(data)
        for reference_id in self._ids_of_file.pop(content_hash, ()):
            self._infos.pop(reference_id, None)
        self.evictions += 1

    def describe(self, reference_id: str) -> ReferenceInfo | None:
        """The upload behind an id (and marks its file recently used), None when unknown or evicted."""
        info = self._infos.get(reference_id)
        if info is not None:
            self._files.move_to_end(info.content_hash)
        return info

    def get_bytes(self, content_hash: str) -> bytes | None:
        data = self._files.get(content_hash)
        if data is not None:
            self._files.move_to_end(content_hash)
        return data

    def stats(self) -> dict[str, int]:
        return {
            "files": len(self._files),
            "references": len(self._infos),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "evictions": self.evictions,
        }


# A store replica at rest: Ray's worker process and Serve's replica around the store (217 MiB of RSS measured on
# Ray 2.60), with room for its threads' buffers and a durable store's client.
STORE_RUNTIME_BYTES = 256 * 2**20


def store_memory_bytes(max_bytes: int, max_upload_bytes: int) -> int:
    """Host memory a store replica asks Ray for: its LRU's cap, one upload that arrives while the LRU is full (it
    is in memory before the oldest files are evicted to make room for it), and the runtime."""
    return max_bytes + max_upload_bytes + STORE_RUNTIME_BYTES


@serve.deployment(name="ReferenceStore", num_replicas=1, max_ongoing_requests=128, ray_actor_options={"num_cpus": 0})
class ReferenceStore:
    """The Serve deployment around a ReferenceLRU and, when configured, DurableReferences.

    LRU operations run on the replica's event loop between awaits, so it needs no lock; storage
    I/O runs in worker threads. A storage failure answers 503 (the client may retry), never 404.
    """

    def __init__(self, max_bytes: int, uri: str | None = None, s3: S3Options | None = None) -> None:
        self._lru = ReferenceLRU(max_bytes)
        self._durable = DurableReferences(uri, s3) if uri else None

    async def put(self, info: ReferenceInfo, data: bytes) -> ReferenceInfo:
        if self._durable is not None:
            await self._storage(self._durable.put, info, data)
        return self._lru.put(info, data)

    async def describe(self, reference_ids: list[str]) -> list[ReferenceInfo | None]:
        infos = [self._lru.describe(r) for r in reference_ids]
        if self._durable is not None:
            for i, reference_id in enumerate(reference_ids):
                if infos[i] is None:
                    infos[i] = await self._load(reference_id)
        return infos

    async def get_bytes(self, content_hashes: list[str]) -> list[bytes | None]:
        files = [self._lru.get_bytes(h) for h in content_hashes]
        if self._durable is not None:
            for i, content_hash in enumerate(content_hashes):
                if files[i] is None:
                    files[i] = await self._storage(self._durable.file, content_hash)
        return files

    async def _load(self, reference_id: str) -> ReferenceInfo | None:
        """An id from durable storage, its file into the cache (the renderer will ask for it next)."""
        info = await self._storage(self._durable.info, reference_id)
        if info is None:
            return None
        data = await self._storage(self._durable.file, info.content_hash)
        if data is None:
            return None
        return self._lru.put(info, data) if len(data) <= self._lru.max_bytes else info

    async def _storage(self, fn, *args):
        try:
            return await asyncio.to_thread(fn, *args)
        except StorageError as e:
            raise ApiError(
                503,
                None,
                f"the reference store is unavailable ({type(e).__name__}); retry later",
                headers={"Retry-After": "5"},
            ) from None
