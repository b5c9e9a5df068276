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

from .backends import Storage
from .metadata import METADATA_PREFIX, read_item_ids

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


def committed_item_ids(storage: Storage) -> set[str]:
    """The item ids present in written metadata parts: the items a resumed job skips."""
    return set(read_item_ids(storage, METADATA_PREFIX))
