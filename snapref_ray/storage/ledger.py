"""Resume and exactly-once: which job owns an output, and which items are already done.

Exactly-once is a property of the output, not of the execution. Images go to deterministic keys, so a
re-render overwrites the same object; an item is *done* when its row is in a written metadata part.
A resumed job skips the ids returned by `committed_item_ids`; a second run of a *different* job on
the same output would mix two datasets, so `claim_output` refuses it unless asked to append.
"""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import pyarrow as pa

from .backends import Storage
from .metadata import METADATA_PREFIX, iter_part_columns
from .sorted_keys import SortedKeys

JOB_KEY = "job.json"
JOB_FORMAT = "snapref-ray/job/1"


class OutputConflictError(RuntimeError):
    """The output already belongs to a job with another fingerprint."""


def _canonical(spec_dict: dict) -> bytes:
    try:
        return json.dumps(
            spec_dict, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"job fingerprint: the spec must be plain JSON data (str, numbers, bools, None, lists, dicts): {e}"
        ) from e


def job_fingerprint(spec_dict: dict) -> str:
    """sha256 (hex) of the canonical JSON of `spec_dict`.

    The caller passes only what determines the images (models, adapter, manifest content, defaults),
    not what does not (worker count, output location), so a job resumed with more GPUs is the same job.
    Key order does not matter; 1 and 1.0 do (JSON keeps them apart), so pass validated, typed values.
    """
    return hashlib.sha256(_canonical(spec_dict)).hexdigest()


def _fingerprints(job: dict) -> set[str]:
    return {job.get("fingerprint")} | {a.get("fingerprint") for a in job.get("appended", [])}


def claim_output(storage: Storage, fingerprint: str, spec_dict: dict, *, append: bool = False) -> None:
    """Mark the output as this job's, or check that it already is.

    First use writes ``job.json`` (conditional create: of two drivers starting at once, one writes and
    the other reads it). A job whose fingerprint is already recorded goes on (resume). Another
    fingerprint raises OutputConflictError, unless `append` is set: then it is added to ``job.json``
    and the new job's items join the same tables. An output with committed metadata but no
    ``job.json`` (written by something else) is treated as foreign the same way.
    """
    record = {
        "format": JOB_FORMAT,
        "fingerprint": fingerprint,
        "spec": spec_dict,
        "claimed_at": time.time(),
        "appended": [],
    }
    body = json.dumps(record, indent=2, sort_keys=True).encode()
    if not storage.exists(JOB_KEY):
        has_rows = bool(storage.list(METADATA_PREFIX + "/"))
        if has_rows and not append:
            raise OutputConflictError(
                f"output {storage.uri} already holds metadata parts but no {JOB_KEY}: it was not written by this job "
                f"(fingerprint {fingerprint[:12]}). Choose another output, or pass append=True to add to it."
            )
        if storage.put_if_absent(JOB_KEY, body):
            return
    job = json.loads(storage.get_bytes(JOB_KEY))
    if fingerprint in _fingerprints(job):
        return
    if not append:
        raise OutputConflictError(
            f"output {storage.uri} belongs to another job: {storage.uri_for(JOB_KEY)} has fingerprint "
            f"{job.get('fingerprint', '?')[:12]}, this job's is {fingerprint[:12]}. Re-run the original "
            f"spec to resume, "
            f"choose another output, or pass append=True to add this job's images to the same dataset."
        )
    job.setdefault("appended", []).append({"fingerprint": fingerprint, "spec": spec_dict, "claimed_at": time.time()})
    storage.put_bytes(JOB_KEY, json.dumps(job, indent=2, sort_keys=True).encode(), content_type="application/json")


def read_job(storage: Storage) -> dict | None:
    """The parsed ``job.json``, or None if the output was never claimed."""
    return json.loads(storage.get_bytes(JOB_KEY)) if storage.exists(JOB_KEY) else None


class CommittedIds:
    """The item ids committed in an output, as their own bytes in one sorted run of `SortedKeys`
    (storage/sorted_keys.py).

    What a resume keeps for a committed output: at 10 M ids of 20 characters a Python ``set`` of ``str``
    is about 1 GB; this is the ids' own bytes, 200 MB, built without a Python object per id. It answers
    ``id in ids`` (a binary search), `contains` for many ids at once (vectorised), ``len`` and `sorted_ids`.
    """

    def __init__(self, sorted_unique: np.ndarray):
        self._ids = SortedKeys.of_sorted_unique(sorted_unique)  # dtype S<width>, sorted, unique

    @classmethod
    def from_arrow(cls, ids: pa.Array | pa.ChunkedArray) -> CommittedIds:
        """From a string column (nulls dropped), without converting each value to a Python object."""
        chunks = ids.chunks if isinstance(ids, pa.ChunkedArray) else [ids]
        return cls.from_arrow_parts(chunks)

    @classmethod
    def from_arrow_parts(cls, parts) -> CommittedIds:
        """From string arrays that come one at a time (metadata parts): each is packed as it arrives, so
        the peak is about twice the packed ids, not the Arrow column as well."""
        packed = [p for p in (_pack(part) for part in parts) if len(p)]
        if not packed:
            return cls(np.array([], dtype="S1"))
        width = max(p.dtype.itemsize for p in packed)
        ids = np.concatenate([p.astype(f"S{width}", copy=False) for p in packed])
        del packed
        ids.sort()  # in place; np.unique would copy, and is ~8x slower on bytes
        keep = np.ones(len(ids), dtype=bool)
        keep[1:] = ids[1:] != ids[:-1]
        return cls(ids if keep.all() else ids[keep])

    @classmethod
    def from_strings(cls, ids) -> CommittedIds:
        """From any iterable of str (tests, small sets)."""
        return cls.from_arrow(pa.array(list(ids), pa.string()))

    @property
    def nbytes(self) -> int:
        """Memory held by the ids."""
        return self._ids.nbytes

    def __len__(self) -> int:
        return len(self._ids)

    def contains(self, ids: list[str] | np.ndarray | pa.Array | pa.ChunkedArray) -> np.ndarray:
        """For each of `ids`, whether it is committed (a bool array); an Arrow string column (no nulls) is
        packed without a Python object per id."""
        if isinstance(ids, pa.ChunkedArray):
            ids = pa.concat_arrays(ids.chunks) if ids.num_chunks else pa.array([], pa.string())
        if isinstance(ids, pa.Array):
            query = _pack(ids)
        else:
            query = np.asarray([i.encode() for i in ids] if isinstance(ids, list) else ids, dtype=np.bytes_)
        return self._ids.find(query)[0]

    def index_of(self, ids: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """For each of `ids` (an Arrow string column, no nulls), its position in the sorted set, or -1 when it is not
        in it: what looks up a value kept beside each id (storage/item_contents.py)."""
        if isinstance(ids, pa.ChunkedArray):
            ids = pa.concat_arrays(ids.chunks) if ids.num_chunks else pa.array([], pa.string())
        return self._ids.rank(_pack(ids))

    def __contains__(self, item_id: object) -> bool:
        return isinstance(item_id, str) and item_id.encode() in self._ids

    def sorted_ids(self) -> list[str]:
        """Every id, sorted by its UTF-8 bytes (= by code point): a Python object per id, for small outputs."""
        return [v.decode() for v in self._ids.sorted_keys()]

    def __repr__(self) -> str:
        return f"CommittedIds({len(self)} ids, {self.nbytes} bytes)"


def _pack(ids: pa.Array) -> np.ndarray:
    """A string array as fixed-width bytes (dtype S<longest>), with no Python object per value."""
    ids = ids.drop_null().cast(pa.large_binary())
    n = len(ids)
    if n == 0:
        return np.array([], dtype="S1")
    offsets = np.frombuffer(ids.buffers()[1], dtype=np.int64, count=n + 1, offset=ids.offset * 8)
    lengths = np.diff(offsets)
    width = max(int(lengths.max()), 1)
    data = np.frombuffer(ids.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    if (lengths == width).all():
        return data.view(f"S{width}").copy()  # ids of one length (hashes): the data buffer is the array
    # Row-major order of the mask is the order of the concatenated values: one vectorised scatter pads
    # every id to `width` with NULs (which numpy's S dtype ignores when comparing).
    padded = np.zeros((n, width), dtype=np.uint8)
    padded[np.arange(width) < lengths[:, None]] = data
    return padded.view(f"S{width}").ravel()


def committed_item_ids(storage: Storage) -> CommittedIds:
    """The item ids present in written metadata parts: the items a resumed job skips (see CommittedIds)."""
    return CommittedIds.from_arrow_parts(
        chunk for table in iter_part_columns(storage, ["item_id"]) for chunk in table.column("item_id").chunks
    )
