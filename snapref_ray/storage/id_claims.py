"""Item ids claimed so far, in 16 bytes an id: what finds a duplicate among millions of ids without a Python object
per id (render_service/work_items.py: a manifest's duplicate rows; storage/metadata.py: a row committed twice in one
run)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def _digest(item_id: str) -> bytes:
    return hashlib.blake2b(item_id.encode(), digest_size=12).digest()


class ClaimedIds:
    """Item ids claimed so far, each with the manifest row that claimed it first, in 16 bytes an id.

    An id is held as a 12-byte blake2b digest (two different ids share one with a probability of about
    n^2 / 2^97: 10^-15 at 10 M ids) and its row as an int32, in sorted runs merged as they grow (the runs'
    sizes halve from the oldest, so there are about log2(n) of them and each id is merged about log2(n)
    times). A Python dict of 10 M ids would hold about 1.5 GB; this holds 160 MB.
    """

    def __init__(self) -> None:
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []  # (sorted digests S12, their rows)

    def __len__(self) -> int:
        return sum(len(digests) for digests, _ in self._runs)

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes + r.nbytes for d, r in self._runs)

    def claim(self, ids: Sequence[str], rows: Sequence[int]) -> list[int | None]:
        """Claim `ids` (from `rows`) in order: for each, None when it is new, else the row that claimed it first
        (an earlier chunk's, or an earlier id of these)."""
        owners: list[int | None] = [None] * len(ids)
        first_here: dict[bytes, int] = {}
        digests = []
        for i, item_id in enumerate(ids):
            digest = _digest(item_id)
            if digest in first_here:
                owners[i] = rows[first_here[digest]]
            else:
                first_here[digest] = i
            digests.append(digest)
        if not first_here:
            return owners
        positions = np.fromiter(first_here.values(), dtype=np.int64, count=len(first_here))
        keys = np.array(list(first_here), dtype="S12")
        new = np.ones(len(keys), dtype=bool)
        for run_digests, run_rows in self._runs:
            at = np.searchsorted(run_digests, keys)
            inside = at < len(run_digests)
            hit = np.zeros(len(keys), dtype=bool)
            hit[inside] = run_digests[at[inside]] == keys[inside]
            for k in np.flatnonzero(hit & new):
                owners[positions[k]] = int(run_rows[at[k]])
            new &= ~hit
        # Later copies of an id first seen in an earlier chunk belong to that chunk's row too.
        for i, digest in enumerate(digests):
            first = first_here[digest]
            if owners[i] is not None and first != i and owners[first] is not None:
                owners[i] = owners[first]
        keys, first_rows = keys[new], np.asarray(rows, dtype=np.int64)[positions[new]].astype(np.int32)
        order = np.argsort(keys, kind="stable")
        self._runs.append((keys[order], first_rows[order]))
        while len(self._runs) >= 2 and len(self._runs[-2][0]) <= 2 * len(self._runs[-1][0]):
            b = self._runs.pop()
            self._runs[-1] = _merge(self._runs[-1], b)
        return owners

    def owner(self, item_id: str) -> int | None:
        """The row that claimed `item_id`, or None when no one has (one id: a binary search per run)."""
        key = np.array([_digest(item_id)], dtype="S12")
        for run_digests, run_rows in self._runs:
            at = int(np.searchsorted(run_digests, key)[0])
            if at < len(run_digests) and run_digests[at] == key[0]:
                return int(run_rows[at])
        return None


def _merge(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Two sorted runs with no digest in common as one: each of b's digests goes to where a binary search puts it
    (plus the b's before it), a's fill the rest. No sort, and no copy beyond the merged run."""
    (a_keys, a_rows), (b_keys, b_rows) = a, b
    at = np.searchsorted(a_keys, b_keys) + np.arange(len(b_keys))
    keys = np.empty(len(a_keys) + len(b_keys), dtype=a_keys.dtype)
    rows = np.empty(len(keys), dtype=np.int32)
    from_a = np.ones(len(keys), dtype=bool)
    from_a[at] = False
    keys[at], rows[at] = b_keys, b_rows
    keys[from_a], rows[from_a] = a_keys, a_rows
    return keys, rows
