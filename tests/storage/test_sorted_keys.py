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
