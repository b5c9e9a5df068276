"""Keys of fixed-width bytes in sorted runs: the one structure behind the project's id sets of millions of ids.

A Python set of 10 M ids holds a Python object per id (about 1 GB); a numpy array of fixed-width bytes (dtype
`S<width>`) holds the bytes alone and answers membership for many keys at once by binary search. Two sets use it:
the ids a job's output has committed (storage/ledger.py `CommittedIds`: the ids' own bytes, built once) and the ids
a planning pass or a run has claimed (storage/id_claims.py `ClaimedIds`: 12-byte digests, each with the row that
claimed it, growing chunk by chunk). Runs grow by appending a sorted run and merging while the newer run is at least
half the older (about log2(n) runs, each key merged about log2(n) times).
"""

from __future__ import annotations

import bisect

import numpy as np


class SortedKeys:
    """Distinct keys (numpy `S<width>`) in sorted runs, each key with an int32 value where the holder keeps one."""

    def __init__(self) -> None:
        # (sorted keys S<width>, their values int32, or None for a set of keys alone: no 4 bytes a key for nothing)
        self._runs: list[tuple[np.ndarray, np.ndarray | None]] = []

    def __len__(self) -> int:
        return sum(len(keys) for keys, _ in self._runs)

    @property
    def run_count(self) -> int:
        """Sorted runs held now (about log2 of the keys: what keeps `find` a few binary searches)."""
        return len(self._runs)

    @property
    def nbytes(self) -> int:
        return sum(keys.nbytes + (values.nbytes if values is not None else 0) for keys, values in self._runs)

    def find(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each key of `query` (a bytes array): whether it is held, and its value (-1 where it is not, or where
        its run keeps none)."""
        found = np.zeros(len(query), dtype=bool)
        values = np.full(len(query), -1, dtype=np.int64)
        for keys, run_values in self._runs:
            if not len(keys) or not len(query):
                continue
            at = np.searchsorted(keys, query)
            inside = at < len(keys)
            hit = np.zeros(len(query), dtype=bool)
            hit[inside] = keys[at[inside]] == query[inside]
            hit &= ~found
            if run_values is not None:
                values[hit] = run_values[at[hit]]
            found |= hit
        return found, values

    def rank(self, query: np.ndarray) -> np.ndarray:
        """For each key of `query` (a bytes array): its position among all the held keys in sorted order (the index
        `sorted_keys()` gives it), -1 where it is not held. What looks up a value a holder keeps in an array aligned
        with the sorted keys; the runs hold no key in common, so a key's position is the sum of its places in each."""
        found, _ = self.find(query)
        at = np.zeros(len(query), dtype=np.int64)
        for keys, _ in self._runs:
            if len(keys) and len(query):
                at += np.searchsorted(keys, query)
        return np.where(found, at, -1)

    def value_of(self, key: bytes) -> int | None:
        """One key's value: None when it is not held, -1 when its run keeps none. A binary search per run and no
        array allocated when none is held: `find` for a single key costs ~10 times more (a driver asks this once per
        committed row)."""
        if not self._runs:
            return None
        # As a one-element array, so that it compares as the runs' elements do (numpy strips trailing null bytes).
        query = np.array([key])
        for keys, run_values in self._runs:
            at = int(np.searchsorted(keys, query)[0])
            if at < len(keys) and keys[at] == query[0]:
                return -1 if run_values is None else int(run_values[at])
        return None

    def __contains__(self, key: bytes) -> bool:
        # bisect over each run: a few microseconds, several times less than a numpy call per key; for many keys
        # at once use `find`.
        for keys, _ in self._runs:
            if len(key) <= keys.dtype.itemsize:
                at = bisect.bisect_left(keys, key)
                if at < len(keys) and keys[at] == key:
                    return True
        return False

    def add(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Hold `keys` too, with their `values`: distinct keys, none of them held yet (`find` them first)."""
        if not len(keys):
            return
        values = np.asarray(values).astype(np.int32)
        order = np.argsort(keys, kind="stable")
        self._runs.append((keys[order], values[order]))
        while len(self._runs) >= 2 and len(self._runs[-2][0]) <= 2 * len(self._runs[-1][0]):
            newer = self._runs.pop()
            self._runs[-1] = _merge(self._runs[-1], newer)

    @classmethod
    def of_sorted_unique(cls, keys: np.ndarray) -> SortedKeys:
        """Keys already sorted and distinct, as one run without values (no copy)."""
        held = cls()
        if len(keys):
            held._runs.append((keys, None))
        return held

    def sorted_keys(self) -> np.ndarray:
        """Every key, sorted (one merged array)."""
        runs = [keys for keys, _ in self._runs]
        return np.sort(np.concatenate(runs)) if len(runs) > 1 else (runs[0] if runs else np.array([], dtype="S1"))


def _merge(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Two sorted runs with no key in common as one: each of b's keys goes to where a binary search puts it (plus
    the b's before it), a's fill the rest. No sort, and no copy beyond the merged run."""
    (a_keys, a_values), (b_keys, b_values) = a, b
    at = np.searchsorted(a_keys, b_keys) + np.arange(len(b_keys))
    width = max(a_keys.dtype.itemsize, b_keys.dtype.itemsize)
    keys = np.empty(len(a_keys) + len(b_keys), dtype=f"S{width}")
    values = np.empty(len(keys), dtype=np.int32)
    from_a = np.ones(len(keys), dtype=bool)
    from_a[at] = False
    keys[at], values[at] = b_keys, b_values
    keys[from_a], values[from_a] = a_keys, a_values
    return keys, values
