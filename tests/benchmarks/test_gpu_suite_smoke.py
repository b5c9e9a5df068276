"""benchmarks/gpu_suite.py --smoke runs every phase end to end (tiny sizes) and writes every documented field.

No timing thresholds: the figures are for the README. What is checked is that each phase runs its
real code path and that its JSON and Markdown carry every figure with numbers that add up.

The end-to-end phase's jobs run on the session's local Ray (tests/conftest.py), this module's job:
the suite uses the Ray its caller is connected to and starts its own only when run as a script.
"""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module", autouse=True)
def ray_job(local_ray_job):
    yield


@pytest.mark.slow
def test_gpu_suite_smoke_writes_json_and_markdown(tmp_path, capsys):
    from benchmarks import gpu_suite

    result = gpu_suite.main(["--smoke", "--out-dir", str(tmp_path)])
    assert json.loads((tmp_path / "gpu_suite.json").read_text()) == json.loads(json.dumps(result))
    assert set(gpu_suite.FIELDS) <= set(result)
    assert set(result["step"]) == {"eager", "compiled", "compiled_speedup"} and not result["skipped"]
    assert set(result["snapref"]) == {
        "no_reference",
        "snapref_default",
        "ref_in_uncond",
        "ref_guidance",
        "recompute_every_step",
        "char_mode",
    }
    assert result["snapref"]["no_reference"]["ratio_to_no_reference"] == 1.0
    assert result["images_per_gpu_hour"]["images_per_gpu_hour"] > 0 and result["memory"]["peak"] > 0
    markdown = (tmp_path / "gpu_suite.md").read_text()
    assert "Images per GPU-hour" in markdown and "| snapref_default | 2 | 1 |" in markdown
    _assert_end_to_end(result["end_to_end"], markdown)


def _assert_end_to_end(e2e: dict, markdown: str) -> None:
    """The smoke run's end-to-end phase: every run rendered its images, and its figures add up."""
    from benchmarks.e2e_runs import SMOKE_RUNS
    from benchmarks.e2e_timings import DEVICE_COMPONENTS, SHARES

    assert [r["run"] for r in e2e["runs"]] == SMOKE_RUNS.split(",") and not e2e["skipped"]
    assert {r["weights"] for r in e2e["runs"]} == {"bf16", "fp8"} and any(r["compiled"] for r in e2e["runs"])
    assert e2e["model_folder"]["check"]["loaded"] and e2e["model_folder"]["set"] == "tiny"
    for r in e2e["runs"]:
        assert "error" not in r, r
        assert r["images"] == 2 and r["failed_items"] == 0
        per_hour = r["images_per_gpu_hour"]
        assert 0 < per_hour["wall"] < per_hour["render"] < per_hour["dit_sampling_only"], r["run"]
        assert all(0 <= r["share_of_wall"][k] <= 1 for k in SHARES), r["share_of_wall"]
        # Every part the device does was timed (the pilot's reference encode too: its VAE encode).
        assert all(r["seconds"][k] > 0 for k in DEVICE_COMPONENTS), r["seconds"]
        # Start-up and the render time are disjoint parts of the wall time, and nearly all of it.
        covered = r["share_of_wall"]["startup"] + sum(
            r["share_of_wall"][k] for k in (*DEVICE_COMPONENTS, "other_render")
        )
        # summary.json rounds the wall, start-up and render seconds to the millisecond each: their sum may pass
        # the rounded wall by up to 1.5 ms.
        assert 0.5 < covered <= 1.0 + 0.0015 / r["wall_seconds"], (covered, r["wall_seconds"])
        # The forwards' sampling seconds and the reference streams', each from the metadata rows and from the
        # renderer's own results; one encode per reference (one worker).
        assert r["seconds"]["dit_sampling"] == pytest.approx(r["dit_sampling_seconds_from_call_log"], rel=1e-4)
        # The rows' encode_s (`row_encode_seconds`) is the encode a render did itself, 0 where its worker held the
        # RefKV (docs/design.md, "The front-door contract", checked at every door by tests/test_cross_path.py);
        # the encode calls are timed from the call log above and below.
        assert r["reference_encodes"] == 1 and r["seconds"]["reference_encode"] > r["reference_stream_seconds"]
        assert r["forwards"] == sum(n // int(b) for b, n in r["forward_batches"].items())
        # The worker's ready reply carries its cold start (render_service/cold_start.py), which the job summary lists; a
        # compiled worker warmed the job's size at the forward sizes the job then ran, before it was ready.
        cold = r["cold_start"]
        assert cold["model_load_s"] > 0 and cold["compiled"] == r["compiled"]
        if r["compiled"]:  # its warm-up rendered the job's forward sizes before it answered ready
            assert cold["first_image_s"] >= cold["model_load_s"]
        else:  # a CPU worker renders no warm-up image (render_service/service.py): no image yet when ready
            assert cold["first_image_s"] is None
        if r["compiled"]:
            ran = sorted(int(b) for b in r["forward_batches"])
            assert cold["warmed"] == [f"256x256 x{b}+ref" for b in ran] and cold["warmup_s"] > 0
        assert f"| {r['run']} | 2 |" in markdown
    assert "## End to end" in markdown


@pytest.mark.slow
def test_gpu_suite_end_to_end_only_starts_what_fits_the_budget(tmp_path, capsys):
    """Without step phases the first run starts unmeasured; the next is skipped when its estimate, from the
    finished run plus three compiles, overruns a 1 s budget."""
    from benchmarks import gpu_suite

    argv = ["--smoke", "--end-to-end-only", "--budget-s", "1", "--e2e-runs", "v2-rg1:fp8:eager,snapref:bf16:compiled"]
    result = gpu_suite.main([*argv, "--out-dir", str(tmp_path)])
    e2e = result["end_to_end"]
    assert not {"step", "snapref", "extra_rows"} & set(result)
    assert [r["run"] for r in e2e["runs"]] == ["v2-rg1:fp8:eager"] and "error" not in e2e["runs"][0]
    assert e2e["runs"][0]["estimate_seconds"] is None and e2e["runs"][0]["images"] == 2
    (skip,) = e2e["skipped"]
    assert skip["run"] == "snapref:bf16:compiled" and skip["estimate_seconds"] > 90 * 3
    assert skip["why"].endswith("0 s left of the budget")
    assert result["skipped"] == ["step phases (--end-to-end-only)", f"end-to-end snapref:bf16:compiled ({skip['why']})"]
    markdown = (tmp_path / "gpu_suite.md").read_text()
    assert "## DiT CFG step" not in markdown and "| v2-rg1:fp8:eager | 2 |" in markdown
    assert "Skipped: step phases (--end-to-end-only); end-to-end snapref:bf16:compiled (estimated" in markdown


def test_gpu_suite_has_arcanima_rows_and_takes_more(tmp_path, capsys):
    """Both ArcAnima kinds are measured beside the plain step; a registered function's figures land too."""
    from benchmarks import gpu_suite, suite_rows

    registered = dict(suite_rows.EXTRA_ROWS)
    suite_rows.register_rows("Example rows", lambda ctx: {"blocks": ctx.bench.geo.dit.num_blocks})
    try:
        result = gpu_suite.main(["--smoke", "--no-compile", "--e2e-runs", "none", "--out-dir", str(tmp_path)])
    finally:
        suite_rows.EXTRA_ROWS.clear()
        suite_rows.EXTRA_ROWS.update(registered)
    assert result["extra_rows"]["Example rows"] == {"blocks": 2}
    arc = result["extra_rows"]["ArcAnima"]
    for kind, rank in (("arcanima-v2", 64), ("arcanima-pilot", 32)):
        assert arc[f"{kind} s/step"] > 0 and arc[f"{kind} x no reference"] > 0 and arc[f"{kind} rank"] == rank
    # The step cache's rows: threshold 0 decides at every step and skips none; an unreachable threshold skips
    # steps of the window (not the first, which has no deltas yet, nor those outside it).
    cache = result["extra_rows"]["Step cache"]
    assert cache["threshold 0 forwards skipped"] == 0
    assert 0 < cache["all-skip forwards skipped"] < cache["loop steps"]
    assert cache["off s/loop"] > 0 and cache["threshold 0 x off (bookkeeping of steps that run)"] > 0
    assert 0 < cache["all-skip x off"] and cache["skipped step x full step"] >= 0
    assert result["host_syncs"]["checked"] is False  # CUDA only
    assert result["skipped"] == ["compiled steps (--no-compile)", "end-to-end runs (--e2e-runs none)"]
    assert "end_to_end" not in result
    markdown = (tmp_path / "gpu_suite.md").read_text()
    assert "## Example rows" in markdown and "| arcanima-pilot x no reference |" in markdown
    assert "## Step cache" in markdown
