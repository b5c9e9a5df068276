"""The identity-gap evaluation job (snapref_ray/jobs/identity_eval.py, jobs/identity_eval.py) on Ray, tiny models."""

from __future__ import annotations

import argparse
import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from snapref_ray.adapter.file import load_adapter
from snapref_ray.eval_cli import add_eval_parsers
from snapref_ray.evaluation import denoising_losses, prepare_target
from snapref_ray.jobs.identity_eval import EvalError, EvalSpec, build_cases, load_eval_spec
from snapref_ray.model_spec import ModelSpec

JOBS = Path(__file__).resolve().parents[1] / "snapref_ray" / "examples"
SIGMAS, SEEDS = [0.3, 0.7], [0, 1]

# Every field docs/evaluate.md documents for heldout_loss.json, and for each of its cases.
REPORT_FIELDS = {
    "format",
    "n_cases",
    "n_characters",
    "n_failed",
    "mean_loss_right",
    "mean_loss_wrong",
    "gap",
    "gap_ci",
    "ci_level",
    "bootstrap",
    "right_wins_fraction",
    "sigmas",
    "noise_seeds",
    "loss",
    "model",
    "adapter",
    "target_megapixels",
    "derangement_seed",
    "manifest",
    "per_sigma",
    "cases",
    "failed",
    "wall_seconds",
    "python",
    "finished_at",
}
CASE_FIELDS = {
    "case_id",
    "manifest_row",
    "character",
    "reference",
    "target",
    "prompt",
    "wrong_reference",
    "wrong_character",
    "wrong_case",
    "mean_loss_right",
    "mean_loss_wrong",
    "gap",
    "right_wins",
    "width",
    "height",
    "right_cache_hit",
    "wrong_cache_hit",
    "seconds",
    "worker_id",
}


def write_manifest(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory, tiny_models: Path) -> Path:
    """Three characters x 2 cases from snapref_ray/examples/example_refs, plus a case whose target is missing."""
    d = tmp_path_factory.mktemp("eval")
    for name in ("silver_hair_girl", "brown_hair_boy", "blue_hair_girl"):
        shutil.copy(JOBS / "example_refs" / f"{name}.png", d / f"{name}.png")
    shutil.copy(tiny_models / "reference.png", d / "ghost.png")
    rows = [
        {
            "id": f"{name}-{k}",
            "character": name,
            "reference": f"{name}.png",
            "target": f"{name}.png",
            "prompt": f"1girl, solo, scene {k}",
        }
        for name in ("silver_hair_girl", "brown_hair_boy", "blue_hair_girl")
        for k in (1, 2)
    ]
    rows.append(
        {
            "id": "ghost-1",
            "character": "ghost",
            "reference": "ghost.png",
            "target": "missing.png",
            "prompt": "1girl, solo",
        }
    )
    write_manifest(d / "manifest.csv", rows)
    spec = {
        "model": {"models_dir": str(tiny_models)},
        "manifest": "manifest.csv",
        "sigmas": SIGMAS,
        "noise_seeds": SEEDS,
        "n_boot": 200,
        "target_megapixels": 0.05,
        "output": {"uri": "out"},
        "cluster": {"cpu_workers": 2},
    }
    (d / "eval.yaml").write_text(yaml.safe_dump(spec))
    return d


@pytest.fixture(scope="module")
def ray_local(local_ray_job):
    """This module's job on the session's local Ray (tests/conftest.py)."""
    return local_ray_job


@pytest.fixture(scope="module")
def job_result(ray_local, eval_dir: Path):
    from jobs.identity_eval import main

    rc = main([str(eval_dir / "eval.yaml")])
    out = eval_dir / "out"
    return rc, json.loads((out / "heldout_loss.json").read_text()), pq.read_table(out / "heldout_loss.parquet")


# ---------------------------------------------------------------------------------------------
# Without Ray


def test_example_spec_and_manifest_load():
    spec = load_eval_spec(str(JOBS / "example_eval_spec.yaml"))
    assert spec.manifest == str(JOBS / "example_eval_manifest.csv")
    assert spec.model.models_dir == str(JOBS.parents[1] / "tiny")  # tiny/ in the repository root
    assert (spec.sigmas, spec.noise_seeds) == ([0.2, 0.4, 0.6, 0.8], [0, 1, 2, 3])
    cases = build_cases(spec)
    assert len(cases) == 6 and len({c["character"] for c in cases}) == 3
    assert all(c["wrong_character"] != c["character"] for c in cases)
    assert all(Path(c["target"]).is_file() and Path(c["reference"]).is_file() for c in cases)
    assert sorted(c["wrong_case"] for c in cases) == sorted(c["case_id"] for c in cases)  # a permutation


def test_character_defaults_to_the_reference_image_and_bad_rows_are_named(tmp_path, eval_dir):
    rows = [
        {"reference": f"{eval_dir}/{n}.png", "target": f"{eval_dir}/{n}.png", "prompt": "x"}
        for n in ("silver_hair_girl", "silver_hair_girl", "brown_hair_boy", "blue_hair_girl")
    ]
    write_manifest(tmp_path / "m.csv", rows)
    spec = EvalSpec(model=ModelSpec(models_dir=str(tmp_path)), manifest=str(tmp_path / "m.csv"))
    cases = build_cases(spec)
    assert cases[0]["character"] == cases[1]["character"] != cases[2]["character"]
    assert all(c["wrong_character"] != c["character"] for c in cases)
    assert [c["case_id"] for c in cases] == ["row1", "row2", "row3", "row4"]

    write_manifest(tmp_path / "bad.csv", [{"reference": rows[0]["reference"], "prompt": "x", "seed": 3}])
    with pytest.raises(EvalError, match=r"row 1: unknown column\(s\) seed .*; missing target"):
        build_cases(spec.model_copy(update={"manifest": str(tmp_path / "bad.csv")}))
    write_manifest(tmp_path / "one.csv", rows[:2] + rows[2:3])
    with pytest.raises(EvalError, match="has 2 of 3 cases"):
        build_cases(spec.model_copy(update={"manifest": str(tmp_path / "one.csv")}))


def test_spec_validates_the_grid():
    with pytest.raises(ValueError, match=r"sigmas must be distinct values in \(0, 1\]"):
        EvalSpec(model=ModelSpec(models_dir="m"), manifest="m.csv", sigmas=[0.5, 1.5])
    with pytest.raises(ValueError, match="noise_seeds must be distinct"):
        EvalSpec(model=ModelSpec(models_dir="m"), manifest="m.csv", noise_seeds=[1, 1])


def test_cli_registers_eval_and_timing():
    parser = argparse.ArgumentParser()
    add_eval_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", "spec.yaml", "--out", "o", "--workers", "3"])
    assert (args.spec, args.out, args.workers, args.func.__name__) == ("spec.yaml", "o", 3, "cmd_eval")
    args = parser.parse_args(["timing", "--models", "m", "--steps", "2"])
    assert (args.model_models_dir, args.steps, args.func.__name__) == ("m", 2, "cmd_timing")


# ---------------------------------------------------------------------------------------------
# Through Ray


@pytest.mark.slow
def test_job_writes_both_files_with_the_documented_fields(job_result, tiny_models):
    rc, report, table = job_result
    assert rc == 1  # one case failed
    assert REPORT_FIELDS <= set(report)
    assert report["format"] == "snapref-ray/heldout_loss/1"
    assert (report["n_cases"], report["n_failed"], report["n_characters"]) == (6, 1, 3)
    assert report["failed"][0]["case_id"] == "ghost-1" and "missing.png" in report["failed"][0]["error"]
    assert (report["sigmas"], report["noise_seeds"]) == (SIGMAS, SEEDS)
    assert report["adapter"]["identity"] == load_adapter(tiny_models / "adapter.safetensors").identity
    assert report["model"]["id"] == "dit.safetensors" and report["model"]["device"] == "cpu"
    lo, hi = report["gap_ci"]
    assert lo <= report["gap"] <= hi
    assert report["gap"] == pytest.approx(report["mean_loss_wrong"] - report["mean_loss_right"], abs=1e-12)
    assert [s["sigma"] for s in report["per_sigma"]] == SIGMAS
    assert len(report["cases"]) == 6
    for case in report["cases"]:
        assert CASE_FIELDS <= set(case)
        assert case["wrong_character"] != case["character"]
        assert case["gap"] == case["mean_loss_wrong"] - case["mean_loss_right"]
        assert case["right_wins"] == (case["gap"] > 0)
    assert report["right_wins_fraction"] == sum(c["right_wins"] for c in report["cases"]) / 6

    assert table.num_rows == 6
    assert set(table.column_names) >= CASE_FIELDS | {"loss_right", "loss_wrong"}
    rows = table.to_pylist()
    assert [r["case_id"] for r in rows] == [c["case_id"] for c in report["cases"]]
    assert all(len(r["loss_right"]) == 2 and len(r["loss_right"][0]) == 2 for r in rows)


@pytest.mark.slow
def test_job_numbers_equal_a_direct_computation(job_result, tiny_renderer, eval_dir):
    """The worker path gives the numbers denoising_losses gives in this process (and so is deterministic)."""
    _, report, table = job_result
    row = table.to_pylist()[0]
    target = prepare_target(Path(row["target"]).read_bytes(), 0.05)
    assert (target.width, target.height) == (row["width"], row["height"]) == (176, 256)
    for role, ref in (("right", row["reference"]), ("wrong", row["wrong_reference"])):
        kv = tiny_renderer.encode_reference(Path(ref).read_bytes(), width=target.width, height=target.height)
        direct = denoising_losses(tiny_renderer, target, row["prompt"], kv, SIGMAS, SEEDS)
        np.testing.assert_allclose(row[f"loss_{role}"], direct.numpy(), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_each_worker_encodes_each_reference_once(job_result):
    _, _, table = job_result
    per_worker: dict[str, dict] = {}
    for r in table.to_pylist():
        seen = per_worker.setdefault(r["worker_id"], {"refs": set(), "misses": 0})
        for role, ref in (("right", r["reference"]), ("wrong", r["wrong_reference"])):
            seen["misses"] += not r[f"{role}_cache_hit"]
            seen["refs"].add(ref)
    for worker, seen in per_worker.items():
        assert seen["misses"] == len(seen["refs"]), worker
