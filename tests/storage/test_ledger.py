"""Resume bookkeeping: one job per output (unless appending), committed ids = done."""

from __future__ import annotations

import hashlib
import json
import threading
import uuid

import pytest

from snapref_ray.storage.backends import LocalStorage, open_storage
from snapref_ray.storage.ledger import (
    OutputConflictError,
    claim_output,
    committed_item_ids,
    job_fingerprint,
    read_job,
)
from snapref_ray.storage.metadata import MetadataWriter
from tests.storage.test_metadata import make_row

SPEC = {
    "models": "s3://models/anima",
    "adapter": "snapref.safetensors",
    "defaults": {"steps": 30, "cfg": 4.0},
    "manifest_sha256": "0" * 64,
}


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path):
    if request.param == "local":
        return open_storage(str(tmp_path / "out"))
    server = request.getfixturevalue("s3_server")
    return open_storage(f"s3://{server.bucket}/ledger-{uuid.uuid4().hex[:8]}", server.s3_options())


def test_fingerprint_is_sha256_of_canonical_json():
    expected = hashlib.sha256(
        b'{"adapter":"snapref.safetensors","defaults":{"cfg":4.0,"steps":30},'
        b'"manifest_sha256":"' + b"0" * 64 + b'","models":"s3://models/anima"}'
    ).hexdigest()
    assert job_fingerprint(SPEC) == expected
    reordered = dict(reversed(list(SPEC.items())))
    assert job_fingerprint(reordered) == expected
    assert job_fingerprint({**SPEC, "defaults": {"steps": 31, "cfg": 4.0}}) != expected
    assert job_fingerprint({"prompt": "日本"}) == hashlib.sha256('{"prompt":"日本"}'.encode()).hexdigest()


def test_fingerprint_refuses_non_json_values():
    with pytest.raises(TypeError, match="job fingerprint: the spec must be plain JSON data"):
        job_fingerprint({"seeds": {1, 2}})
    with pytest.raises(TypeError, match="job fingerprint"):
        job_fingerprint({"cfg": float("nan")})


def test_claim_resume_conflict_and_append(storage):
    fp = job_fingerprint(SPEC)
    claim_output(storage, fp, SPEC)
    job = read_job(storage)
    assert (job["format"], job["fingerprint"], job["spec"], job["appended"]) == ("snapref-ray/job/1", fp, SPEC, [])

    claim_output(storage, fp, SPEC)  # the same job again: a resume

    other = {**SPEC, "defaults": {"steps": 50, "cfg": 4.0}}
    ofp = job_fingerprint(other)
    with pytest.raises(OutputConflictError) as e:
        claim_output(storage, ofp, other)
    assert str(e.value) == (
        f"output {storage.uri} belongs to another job: {storage.uri_for('job.json')} has fingerprint {fp[:12]}, "
        f"this job's is {ofp[:12]}. Re-run the original spec to resume, choose another output, or pass "
        f"append=True to add this job's images to the same dataset."
    )
    assert read_job(storage)["appended"] == []

    claim_output(storage, ofp, other, append=True)
    job = read_job(storage)
    assert job["fingerprint"] == fp
    assert [(a["fingerprint"], a["spec"]) for a in job["appended"]] == [(ofp, other)]
    claim_output(storage, ofp, other)  # the appended job may resume without append=True
    claim_output(storage, fp, SPEC)


def test_output_with_foreign_metadata_is_refused(tmp_path):
    storage = LocalStorage(tmp_path)
    with MetadataWriter(storage, flush_seconds=0) as w:
        w.add(make_row(1))
    fp = job_fingerprint(SPEC)
    with pytest.raises(OutputConflictError, match=r"already holds metadata parts but no job.json"):
        claim_output(storage, fp, SPEC)
    assert not storage.exists("job.json")
    claim_output(storage, fp, SPEC, append=True)
    assert read_job(storage)["fingerprint"] == fp


def test_two_drivers_claiming_at_once(tmp_path):
    storage = LocalStorage(tmp_path)
    specs = [{"job": i} for i in range(4)]
    outcomes: list[str] = []
    barrier = threading.Barrier(len(specs))

    def claim(spec):
        barrier.wait()
        try:
            claim_output(storage, job_fingerprint(spec), spec)
            outcomes.append("claimed")
        except OutputConflictError:
            outcomes.append("refused")

    threads = [threading.Thread(target=claim, args=(s,)) for s in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(outcomes) == ["claimed", "refused", "refused", "refused"]
    winner = json.loads(storage.get_bytes("job.json"))
    assert winner["fingerprint"] in {job_fingerprint(s) for s in specs}


def test_committed_ids_are_the_written_rows_only(storage):
    assert len(committed_item_ids(storage)) == 0
    writer = MetadataWriter(storage, flush_rows=2, flush_seconds=0)
    for i in range(3):
        writer.add(make_row(i))
    # Two rows are in a written part; the third is still buffered, so not done: a crash now re-renders it.
    assert committed_item_ids(storage).sorted_ids() == ["item-0000", "item-0001"]
    writer.close()
    assert committed_item_ids(storage).sorted_ids() == ["item-0000", "item-0001", "item-0002"]


def test_the_compact_committed_ids_answer_what_a_python_set_would():
    import random

    from snapref_ray.storage.ledger import CommittedIds

    rng = random.Random(7)
    hashes = [f"{rng.getrandbits(80):020x}" for _ in range(300)]
    named = [f"row{i}-{j}" for i in range(40) for j in range(2)] + ["キャラ-0", "café-1", "x"]
    ids = hashes + named + rng.sample(hashes, 50)  # duplicates, as parts committed twice hold
    rng.shuffle(ids)
    oracle = set(ids)
    committed = CommittedIds.from_strings(ids)
    assert len(committed) == len(oracle)
    assert committed.sorted_ids() == sorted(oracle)  # sorted by UTF-8 bytes = by code point
    absent = ["row1", "row1-00", "row40-0", "", "キャラ", "café-1x", f"{rng.getrandbits(80):020x}", "y" * 40]
    queries = list(oracle) + absent
    assert [q in committed for q in queries] == [q in oracle for q in queries]
    assert committed.contains(queries).tolist() == [q in oracle for q in queries]
    # The ids' own bytes, padded to the longest: no Python object per id.
    assert committed.nbytes == len(oracle) * max(len(i.encode()) for i in oracle)
    # Built part by part (as from metadata parts): parts of one id length and of several, nulls dropped.
    import pyarrow as pa

    parts = [pa.array(hashes[:100]), pa.array(named + [None]), pa.array(hashes[50:150]), pa.array([], pa.string())]
    assert CommittedIds.from_arrow_parts(parts).sorted_ids() == sorted(set(hashes[:150]) | set(named))
    empty = CommittedIds.from_strings([])
    assert len(empty) == 0 and "x" not in empty and empty.sorted_ids() == []
    assert empty.contains(["x"]).tolist() == [False]


def test_index_of_is_each_ids_place_in_the_sorted_ids():
    """What storage/item_contents.py looks a committed id's content id up by: its index in `sorted_ids()`."""
    import pyarrow as pa

    from snapref_ray.storage.ledger import CommittedIds

    committed = CommittedIds.from_strings(["b-0", "a-0", "キャラ-0", "c-1", "a-0"])
    order = committed.sorted_ids()
    queries = ["c-1", "zz", "a-0", "キャラ-0", "b-0", ""]
    expected = [order.index(q) if q in order else -1 for q in queries]
    assert committed.index_of(pa.array(queries)).tolist() == expected == [2, -1, 0, 3, 1, -1]
    assert committed.index_of(pa.chunked_array([pa.array(queries[:2]), pa.array(queries[2:])])).tolist() == expected
    assert CommittedIds.from_strings([]).index_of(pa.array(["a-0"])).tolist() == [-1]
