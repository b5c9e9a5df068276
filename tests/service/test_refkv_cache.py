import threading
import time

import pytest
import torch

from snapref_ray.adapter.refkv import RefKV
from snapref_ray.render_service.refkv_cache import RefKVCache


def kv_of(nbytes_blocks: int, ref_id: str) -> RefKV:
    # 1 block x 2 x 1 head x n tokens x 4 dims x 4 bytes = 32 * n bytes
    return RefKV(torch.zeros(1, 2, 1, nbytes_blocks, 4), ((1, 1, nbytes_blocks),), ((0, 0, 0),), (1, 1, 1), "a", ref_id)


def test_lru_evicts_least_recently_used_within_the_byte_budget():
    cache = RefKVCache(max_bytes=32 * 10)
    cache.put("a", kv_of(4, "a"))
    cache.put("b", kv_of(4, "b"))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", kv_of(4, "c"))  # 12 > 10 units: b goes
    assert cache.keys() == ["a", "c"]
    assert cache.nbytes == 32 * 8
    assert cache.stats.evictions == 1


def test_entry_larger_than_budget_is_returned_but_not_kept():
    cache = RefKVCache(max_bytes=32)
    kv, hit = cache.get_or_create("big", lambda: kv_of(4, "big"))
    assert not hit and kv.reference_id == "big"
    assert "big" not in cache


def test_concurrent_misses_on_one_key_encode_once():
    cache = RefKVCache(max_bytes=10**9)
    calls = []

    def slow_encode():
        calls.append(1)
        time.sleep(0.2)
        return kv_of(2, "same")

    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get_or_create("k", slow_encode))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert sorted(hit for _, hit in results) == [False, True, True, True]
    assert cache.stats.encodes == 1 and cache.stats.misses == 1 and cache.stats.hits == 3


def test_a_failed_encode_reaches_its_caller_and_the_next_caller_retries():
    cache = RefKVCache(max_bytes=10**9)

    def fail():
        raise RuntimeError("corrupt reference")

    with pytest.raises(RuntimeError, match="corrupt reference"):  # not swallowed, not cached
        cache.get_or_create("k", fail)
    assert "k" not in cache and cache.stats.encodes == 0
    kv, hit = cache.get_or_create("k", lambda: kv_of(1, "ok"))
    assert not hit and kv.reference_id == "ok" and "k" in cache
    assert (cache.stats.misses, cache.stats.encodes, cache.stats.hits) == (2, 1, 0)
