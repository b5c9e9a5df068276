"""SortedKeys: keys in several sorted runs answer as one sorted array would."""

from __future__ import annotations

import random

import numpy as np

from snapref_ray.storage.sorted_keys import SortedKeys


def test_rank_is_the_place_in_the_sorted_keys_across_runs():
    rng = random.Random(3)
    keys = [f"{rng.getrandbits(48):012x}".encode() for _ in range(500)]
    held = SortedKeys()
    for start in range(0, 500, 37):  # chunks of uneven size: several runs, some merged
        chunk = np.array(keys[start : start + 37], dtype="S12")
        held.add(chunk, np.arange(len(chunk)))
    assert held.run_count > 1
    everything = held.sorted_keys().tolist()
    absent = [f"{rng.getrandbits(48):012x}".encode() for _ in range(20)]
    query = np.array(keys[::7] + absent, dtype="S12")
    expected = [everything.index(k) if k in everything else -1 for k in query.tolist()]
    assert held.rank(query).tolist() == expected
    assert set(expected[len(keys[::7]) :]) == {-1}
    assert SortedKeys().rank(query).tolist() == [-1] * len(query)


def test_value_of_one_key_is_what_find_says_including_keys_that_end_in_null_bytes():
    rng = random.Random(5)
    # Digests can end in b"\x00": numpy strips trailing nulls from an element it hands back, and the lookup of one
    # key must still find it.
    keys = [rng.randbytes(10) + (b"\x00\x00" if i % 4 == 0 else rng.randbytes(2)) for i in range(600)]
    held = SortedKeys()
    for start in range(0, 600, 53):
        chunk = np.array(keys[start : start + 53], dtype="S12")
        held.add(chunk, np.arange(start, start + len(chunk)))
    assert held.run_count > 1
    assert [held.value_of(k) for k in keys] == list(range(600))
    absent = [rng.randbytes(12) for _ in range(50)]
    assert [held.value_of(k) for k in absent] == [None] * len(absent)
    assert SortedKeys().value_of(keys[0]) is None
    alone = SortedKeys.of_sorted_unique(np.array(sorted(keys[:5]), dtype="S12"))  # a run without values
    assert alone.value_of(keys[0]) == -1 and alone.value_of(keys[10]) is None
