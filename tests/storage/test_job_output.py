"""The job output as one driver run holds it (storage/job_output.py), without Ray: the lease is taken before the
claim, the fence stops a driver that lost the output from writing anything more (rows, errors, summary,
compaction), what an earlier driver left staged is settled before the committed ids are read, and a compaction
that fails does not fail the run."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest

from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.job_output import JobOutput, OutputSettings
from snapref_ray.storage.lease import LeaseLostError, OutputLease, current_lease
from snapref_ray.storage.ledger import read_job
from snapref_ray.storage.metadata import METADATA_SCHEMA, read_errors_table, read_item_ids, read_summary
from snapref_ray.storage.shards import COMMITTED, ShardWriter, decide, verdict


def _row(item_id: str) -> dict:
    return dict.fromkeys(METADATA_SCHEMA.names) | {"item_id": item_id, "prompt": "p"}


def _settings(fingerprint: str = "job-a", **kw) -> OutputSettings:
    return OutputSettings(fingerprint=fingerprint, spec={"job": fingerprint}, flush_seconds=0, **kw)


def test_a_run_commits_rows_and_errors_then_its_summary_and_lets_go(tmp_path):
    storage = open_storage(str(tmp_path / "out"))
    output = JobOutput.open(storage, _settings())
    output.commit_row(_row("a"))
    output.record_error("ValueError: bad", "sample", item_id="b", manifest_row=2)
    output.finish({"images_total": 1})
    assert read_item_ids(storage) == ["a"] and read_errors_table(storage).column("item_id").to_pylist() == ["b"]
    assert read_summary(storage) == {"images_total": 1}
    assert current_lease(storage).released
    assert read_job(storage)["fingerprint"] == "job-a"


def test_a_driver_that_lost_the_output_writes_nothing_more(tmp_path):
    storage = open_storage(str(tmp_path / "out"))
    output = JobOutput.open(storage, _settings())
    output.commit_row(_row("a"))
    output.metadata.flush()
    # The driver stalls past its lease (its record, and its own idea of it, run out) and another one takes over.
    stored = json.loads(storage.get_bytes("lease/000000000000.json")) | {"expires_at": 0.0}
    storage.put_bytes("lease/000000000000.json", json.dumps(stored).encode())
    output.lease._record = dataclasses.replace(output.lease.record, expires_at=0.0)
    successor = OutputLease.acquire(storage, job_id="successor", duration_s=30)
    output.commit_row(_row("b"))  # buffered only
    with pytest.raises(LeaseLostError, match="taken over by job successor"):
        output.finish({"images_total": 2})
    assert read_item_ids(storage) == ["a"]  # b never committed
    assert read_summary(storage) is None and read_errors_table(storage).num_rows == 0
    assert current_lease(storage).holder_id == successor.record.holder_id  # and the successor keeps the output
    successor.release()


def test_what_an_earlier_driver_left_staged_is_settled_before_the_committed_ids_are_read(tmp_path):
    storage = open_storage(str(tmp_path / "out"))
    JobOutput.open(storage, _settings(webdataset=True)).finish({})  # the earlier driver's run claimed it
    writer = ShardWriter(storage, name="w", max_items=1)
    writer.add(_row("decided"), b"png 1", "png", "p")
    writer.add(_row("undecided"), b"png 2", "png", "p")
    decided, undecided = (c.key for c in writer.drain())
    decide(storage, decided, COMMITTED)  # the earlier driver decided this one, then died
    output = JobOutput.open(storage, _settings(webdataset=True))
    assert "decided" in output.done_before and "undecided" not in output.done_before
    assert verdict(storage, undecided) == "void" and storage.list("staging/") == []
    output.finish({})


def test_two_appending_drivers_started_together_both_keep_their_fingerprint(tmp_path):
    storage = open_storage(str(tmp_path / "out"))
    JobOutput.open(storage, _settings("job-a")).finish({})
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def driver(fingerprint: str) -> None:
        barrier.wait()
        try:
            settings = _settings(fingerprint, append=True, lease_wait_seconds=30)
            JobOutput.open(open_storage(str(tmp_path / "out")), settings).finish({})
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=driver, args=(f,)) for f in ("job-b", "job-c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    job = read_job(storage)
    assert sorted(a["fingerprint"] for a in job["appended"]) == ["job-b", "job-c"]  # the claim is under the lease


def test_a_compaction_that_fails_at_the_start_does_not_fail_the_run(tmp_path, monkeypatch, caplog):
    from snapref_ray.storage import job_output

    def broken(storage):
        raise OSError("the store refused a merged part")

    monkeypatch.setattr(job_output, "compact_output_parts", broken)
    storage = open_storage(str(tmp_path / "out"))
    output = JobOutput.open(storage, _settings())
    assert "could not compact the output's parts before rendering" in caplog.text
    output.finish({})
