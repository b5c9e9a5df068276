"""What a job asks Ray for: GPU workers on a cluster whatever is up now, CPU workers only for device cpu
or a local machine without GPUs; min/max from the spec; the quick form's flags reach the spec."""

from __future__ import annotations

import pytest

from snapref_ray.cli import build_parser
from snapref_ray.cluster.pool import PoolPlan, PoolShape, plan_pool
from snapref_ray.job_spec import JobSpecError, quick_spec
from snapref_ray.model_spec import ModelSpec


@pytest.mark.parametrize(
    "device, on_cluster, gpus_now, shape, expected",
    [
        # A cold autoscaling cluster: no GPU up yet, still GPU workers (their demand brings the nodes).
        ("auto", True, 0, PoolShape(min_workers=1, max_workers=4), PoolPlan(True, 1, 4)),
        ("auto", True, 0, PoolShape(), PoolPlan(True, 1, 1)),
        ("auto", True, 3, PoolShape(), PoolPlan(True, 1, 3)),
        ("cuda", False, 0, PoolShape(max_workers=2), PoolPlan(True, 1, 2)),
        # A laptop without GPUs: the demo's CPU workers.
        ("auto", False, 0, PoolShape(), PoolPlan(False, 1, 2)),
        ("auto", False, 2, PoolShape(), PoolPlan(True, 1, 2)),
        ("cpu", True, 8, PoolShape(cpu_workers=3), PoolPlan(False, 1, 3)),
        # num_workers: exactly N.
        ("auto", True, 0, PoolShape(num_workers=5), PoolPlan(True, 5, 5)),
        ("auto", True, 0, PoolShape(min_workers=3), PoolPlan(True, 3, 3)),
    ],
)
def test_plan(device, on_cluster, gpus_now, shape, expected):
    assert plan_pool(shape, device, on_cluster=on_cluster, gpus_now=gpus_now) == expected


def test_worker_counts_are_checked_in_the_spec(tmp_path):
    with pytest.raises(JobSpecError, match="min_workers \\(4\\) is above max_workers \\(2\\)"):
        quick_spec("m.csv", str(tmp_path), model=ModelSpec(models_dir="models"), min_workers=4, max_workers=2)
    with pytest.raises(JobSpecError, match="give num_workers \\(exactly N\\) or min_workers/max_workers"):
        quick_spec("m.csv", str(tmp_path), model=ModelSpec(models_dir="models"), workers=2, max_workers=3)


def test_quick_form_flags_reach_the_cluster_section(tmp_path, monkeypatch):
    import snapref_ray.jobs.generate_dataset as job
    from snapref_ray.jobs.job_summary import JobSummary

    seen = {}
    monkeypatch.setattr(
        job,
        "run_job",
        lambda spec, **kw: (
            seen.setdefault("spec", spec)
            and JobSummary.model_construct(
                memory_per_worker=None,
                memory_fit=[],
                failed_items=0,
                images_total=0,
                output="",
                images_this_run=0,
                skipped_already_done=0,
                invalid_rows=0,
                images_per_hour=0.0,
                encodes_per_reference=0.0,
                items=0,
                job_images=0,
                not_rendered=[],
                runs=[],
            )
        ),
    )
    args = build_parser().parse_args(
        ["render", "m.csv", "--models", "models", "--out", str(tmp_path), "--min-workers", "2", "--max-workers", "6"]
    )
    assert args.func(args) == 0
    cluster = seen["spec"].cluster
    assert (cluster.num_workers, cluster.min_workers, cluster.max_workers) == (None, 2, 6)
