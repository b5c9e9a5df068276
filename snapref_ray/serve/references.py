"""Where uploaded reference files live so that any renderer replica can encode them.

Design: one small Serve deployment, `ReferenceStore`, holds the files in memory in an LRU
bounded in bytes, keyed by content hash, plus the reference ids (file hash + caption +
megapixels) that point at each file.

- Why not on the ingress: there may be several ingress replicas, and the replica that encodes
  a reference is chosen by the router, not by who received the upload.
- Why not the object store: an object `ray.put` by the ingress dies with it, and pinning
  thousands of refs from a driver-less process has no natural owner or eviction.
- Why one replica: a put and a later get must meet; files are small (at most
  `limits.max_upload_bytes`) and each is fetched once per renderer replica that encodes it
  (the RefKV cache does the rest), so one process on a CPU carries the traffic.
- What it costs: the store is in memory; if it restarts (or evicts an old file) a render naming
  that id gets 404 and the client uploads it again.
"""

from __future__ import annotations

from collections import OrderedDict

from ray import serve

from snapref_ray.serve.api import ReferenceInfo


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
        return {"files": len(self._files), "references": len(self._infos), "bytes": self.nbytes,
                "max_bytes": self.max_bytes, "evictions": self.evictions}


@serve.deployment(name="ReferenceStore", num_replicas=1, max_ongoing_requests=128,
                  ray_actor_options={"num_cpus": 0})
class ReferenceStore:
    """The Serve deployment around a ReferenceLRU. Methods are async without awaits: they run on the
    replica's event loop one at a time, so the LRU needs no lock."""

    def __init__(self, max_bytes: int) -> None:
        self._lru = ReferenceLRU(max_bytes)

    async def put(self, info: ReferenceInfo, data: bytes) -> ReferenceInfo:
        return self._lru.put(info, data)

    async def describe(self, reference_ids: list[str]) -> list[ReferenceInfo | None]:
        return [self._lru.describe(r) for r in reference_ids]

    async def get_bytes(self, content_hashes: list[str]) -> list[bytes | None]:
        return [self._lru.get_bytes(h) for h in content_hashes]
