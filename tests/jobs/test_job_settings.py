"""The job spec read once into each part's settings (snapref_ray/jobs/job_settings.py), and the workers'
configuration that the plan completes (snapref_ray/jobs/generate_dataset.py `worker_config`). Nothing is started:
no Ray, no output."""

from __future__ import annotations

from snapref_ray.job_spec import spec_fingerprint
from snapref_ray.jobs.generate_dataset import worker_config
from snapref_ray.jobs.job_settings import JobSettings
from snapref_ray.jobs.manifest_check import ManifestSettings
from snapref_ray.jobs.spilled_items import SpilledItems
from snapref_ray.storage.ledger import CommittedIds, job_fingerprint
from tests.service.test_work_items import png, sha, spec_for, write_manifest


def test_each_part_gets_its_own_settings_with_the_one_fingerprint(tmp_path):
    spec = spec_for(
        tmp_path / "m.csv",
        defaults={"width": 256, "height": 384},
        output={"uri": str(tmp_path / "out"), "append": True, "format": "webdataset", "lease_seconds": 90.0},
        cluster={"max_batch": 3, "max_attempts": 5, "transfer_gbps": 10.0, "max_workers": 2, "memory_per_worker": 7},
        strict=True,
    )
    job = JobSettings.of(spec)
    fingerprint = job_fingerprint(spec_fingerprint(spec))
    assert job.output.fingerprint == job.worker.job == fingerprint  # what job.json and every row record
    assert job.output.settings.spec == spec_fingerprint(spec)
    assert (job.output.uri, job.output.settings.append, job.output.settings.webdataset) == (
        str(tmp_path / "out"),
        True,
        True,
    )
    assert job.output.settings.lease_seconds == 90.0 and job.output.rerender_changed is False
    assert job.manifest == ManifestSettings(
        manifest=str(tmp_path / "m.csv"),
        defaults=spec.defaults,
        allow_empty_prompt=False,
        strict=True,
        s3=job.output.s3,
    )
    assert (job.scheduler.max_batch, job.pool.max_batch, job.scheduler.max_attempts, job.max_attempts) == (3, 3, 5, 5)
    assert job.scheduler.transfer_bytes_per_s == 10.0 * 1e9 / 8 and job.transfer_gbps == 10.0
    assert (job.pool.shape.max_workers, job.pool.memory_per_worker, job.pool.device) == (2, 7, spec.model.device)
    assert job.model == spec.model and job.worker.output_format == "webdataset" and job.worker.judge is None


def test_the_plan_completes_the_workers_configuration(tmp_path):
    refs = tmp_path / "refs"
    refs.mkdir()
    colours = [(200, 30, 30), (30, 200, 30)]
    for k, colour in enumerate(colours):
        (refs / f"r{k}.png").write_bytes(png(colour))
    rows = [{"reference": "refs/r0.png", "prompt": f"1girl, scene {k}", "seed": k} for k in range(5)]
    rows.append({"reference": "refs/r1.png", "prompt": "1boy", "seed": 9, "width": 512, "height": 512})
    spec = spec_for(
        write_manifest(tmp_path / "m.csv", rows),
        defaults={"width": 256, "height": 384, "steps": 4},
        cluster={"max_batch": 2},
        judge={"identity_gap": {}},
    )
    job = JobSettings.of(spec)
    bare = worker_config(job)  # no plan: the defaults' size, one image a forward, no contrast references
    assert (bare.warmup_sizes, bare.warmup_batch_sizes, bare.judge_contrasts) == (((256, 384),), (1,), ())
    assert bare.memory_budget_bytes is None and bare.judge is not None
    with SpilledItems.build(job.manifest, adapter_kind="snapref") as plan:
        plan.skip_committed(CommittedIds.from_strings([]))
        config = worker_config(job, warmup=False, memory_budget_bytes=3 << 30, plan=plan)
    assert config.warmup_sizes == ((256, 384), (512, 512))  # the plan's sizes, not the defaults'
    assert config.warmup_batch_sizes == (1, 2)  # r0's five items: 2 + 2 + 1; r1's one: 1
    assert (config.warmup, config.memory_budget_bytes, config.job) == (False, 3 << 30, job.output.fingerprint)
    assert [task.reference_hash for task in config.judge_contrasts] == [
        sha((refs / f"r{k}.png").read_bytes()) for k in range(2)
    ]
