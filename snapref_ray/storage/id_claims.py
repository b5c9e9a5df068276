"""Item ids claimed so far, in 16 bytes an id: what finds a duplicate among millions of ids without a Python object
per id (jobs/manifest_check.py: a manifest's duplicate rows; storage/metadata.py: a row committed twice in one
run)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from .sorted_keys import SortedKeys


def _digest(item_id: str) -> bytes:
    return hashlib.blake2b(item_id.encode(), digest_size=12).digest()


class ClaimedIds:
    """Item ids claimed so far, each with the manifest row that claimed it first, in 16 bytes an id.

    An id is held as a 12-byte blake2b digest (two different ids share one with a probability of about
    n^2 / 2^97: 10^-15 at 10 M ids) and its row as an int32, in the sorted runs of `SortedKeys`
    (storage/sorted_keys.py). A Python dict of 10 M ids would hold about 1.5 GB; this holds 160 MB.
    """

    def __init__(self) -> None:
        self._claimed = SortedKeys()  # 12-byte digests, each with the row that claimed it

    def __len__(self) -> int:
        return len(self._claimed)

    @property
    def nbytes(self) -> int:
        return self._claimed.nbytes

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
        held, first_rows = self._claimed.find(keys)
        for k in np.flatnonzero(held):
            owners[positions[k]] = int(first_rows[k])
        # Later copies of an id first seen in an earlier chunk belong to that chunk's row too.
        for i, digest in enumerate(digests):
            first = first_here[digest]
            if owners[i] is not None and first != i and owners[first] is not None:
                owners[i] = owners[first]
        new = ~held
        self._claimed.add(keys[new], np.asarray(rows, dtype=np.int64)[positions[new]])
        return owners

    def owner(self, item_id: str) -> int | None:
        """The row that claimed `item_id`, or None when no one has (one id: a binary search per run)."""
        return self._claimed.value_of(_digest(item_id))
