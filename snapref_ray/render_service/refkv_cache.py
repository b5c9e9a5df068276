"""An LRU of RefKVs bounded in bytes, safe for threads, that encodes each key once.

Each render service (a job worker, a Serve replica, a Ray Data actor) keeps one on its device, keyed by
`RefKVKey` (render_service/references.py). `get_or_create` makes concurrent callers asking for the same
missing reference wait for a single encode instead of running the reference stream twice; `stats`
are the one set of hit/encode counters every front door reports.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the cache holds RefKVs and never builds one: a driver sets its size without torch
    from snapref_ray.adapter.refkv import RefKV

DEFAULT_REFKV_CACHE_BYTES = 8 * 2**30


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    encodes: int = 0
    evictions: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "encodes": self.encodes, "evictions": self.evictions}


class RefKVCache:
    """At most `max_bytes` of RefKV; the least recently used entries are evicted first.

    An entry larger than the whole budget is still returned to its caller, just not kept.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, RefKV] = OrderedDict()
        self._lock = threading.Lock()
        self._pending: dict[Hashable, threading.Event] = {}
        self.stats = CacheStats()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(kv.nbytes for kv in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._entries)

    def get(self, key: Hashable) -> RefKV | None:
        """The cached RefKV (counted as a hit), or None (not counted: `get_or_create` counts the miss)."""
        with self._lock:
            kv = self._entries.get(key)
            if kv is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
            return kv

    def put(self, key: Hashable, kv: RefKV) -> None:
        with self._lock:
            self._entries[key] = kv
            self._entries.move_to_end(key)
            self._evict_locked()

    def discard(self, key: Hashable) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def _evict_locked(self) -> None:
        total = sum(kv.nbytes for kv in self._entries.values())
        while total > self.max_bytes and self._entries:
            _, evicted = self._entries.popitem(last=False)
            total -= evicted.nbytes
            self.stats.evictions += 1

    def get_or_create(self, key: Hashable, create: Callable[[], RefKV]) -> tuple[RefKV, bool]:
        """(RefKV, was_hit). Concurrent misses on one key run `create` once; the others wait for it."""
        while True:
            with self._lock:
                kv = self._entries.get(key)
                if kv is not None:
                    self._entries.move_to_end(key)
                    self.stats.hits += 1
                    return kv, True
                waiter = self._pending.get(key)
                if waiter is None:
                    done = threading.Event()
                    self._pending[key] = done
                    self.stats.misses += 1
                    break
            # The entry is normally there when the creator is done; if its encode failed (or the
            # entry exceeded the budget), the next pass makes this caller the creator.
            waiter.wait()
        try:
            kv = create()
            with self._lock:
                self.stats.encodes += 1
                if kv.nbytes <= self.max_bytes:
                    self._entries[key] = kv
                    self._evict_locked()
            return kv, False
        finally:
            with self._lock:
                self._pending.pop(key).set()
