"""The end-to-end phase's parts: the model folder it writes, the runs and their budget, the time breakdown.

The real-size folder is never written here (5.5 GB): its plan (keys and shapes from the module trees on
the meta device) is compared with the released files' listings, byte counts are re-derived from those
listings, and the writer is run at a smaller geometry, its files compared with the plan at that geometry
and loaded through the project's loaders. The whole phase runs in the suite's smoke test
(test_gpu_suite_smoke.py).
"""

from __future__ import annotations

import math
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.e2e_runs import (
    DEFAULT_RUNS,
    REAL_RECIPE,
    SMOKE_RECIPE,
    Done,
    RunEstimator,
    RunSpec,
    parse_runs,
    recipe_for,
)
from benchmarks.e2e_timings import DEVICE_COMPONENTS, SHARES, time_breakdown
from benchmarks.end_to_end import PhaseConfig, run_phase
from benchmarks.model_folder import (
    ADAPTER_FILES,
    DIT_FILE,
    REAL_SET,
    SCALED_SET,
    TEXT_ENCODER_FILE,
    TINY_SET,
    VAE_FILE,
    ModelFolderWriter,
    adapter_parameters,
    check_model_folder,
    planned_bytes,
    planned_tensors,
    read_key_listing,
    reduced_set,
    write_model_folder,
)

LISTINGS = {
    DIT_FILE: ("keys-anima-dit-comfyui.txt", "net."),
    TEXT_ENCODER_FILE: ("keys-qwen3-0.6b.txt", ""),
    VAE_FILE: ("keys-qwen-image-vae-comfyui.txt", ""),
}


def _listing_numel(path: Path) -> int:
    """Elements of every tensor a listing names, read straight from its text."""
    total = 0
    for line in path.read_text().splitlines():
        dims = [int(d) for d in line.split("\t")[1].strip("[]").split(",")]
        total += math.prod(dims)
    return total


def _data_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file: its size less the 8-byte length and the JSON header."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - header_len


# --- the model folder -----------------------------------------------------------------------------


def test_real_size_plan_equals_the_released_listings(ref_keys_dir):
    planned = planned_tensors(REAL_SET)
    for name, (listing, prefix) in LISTINGS.items():
        expected = read_key_listing(ref_keys_dir / listing)
        ours = {k.removeprefix(prefix): shape for k, shape in planned[name].items()}
        assert all(k.startswith(prefix) for k in planned[name]), name
        assert ours == expected, name
    assert [len(planned[n]) for n in LISTINGS] == [685, 310, 194]


def test_real_size_bytes_follow_from_the_listings(ref_keys_dir):
    sizes = planned_bytes(REAL_SET)
    for name, (listing, _) in LISTINGS.items():
        assert sizes[name] == 2 * _listing_numel(ref_keys_dir / listing), name  # bf16: 2 bytes an element
    # The parameter counts the model notes give: DiT 2,091,068,928; Qwen3-0.6B 596,049,920; VAE 126,892,531.
    assert (sizes[DIT_FILE], sizes[TEXT_ENCODER_FILE], sizes[VAE_FILE]) == (4_182_137_856, 1_192_099_840, 253_785_062)
    # Adapters: SnapRef ranks 128 / 64 (190,840,832 parameters); ArcAnima, ten linears a block at the published
    # ranks: 28 x rank x sum(in + out) = 28 x rank x 51,200, so 91,750,400 at 64 (v2) and half of it at 32.
    assert adapter_parameters(REAL_SET) == {
        "snapref": 190_840_832,
        "arcanima-v2": 28 * 64 * 51_200,
        "arcanima-pilot": 28 * 32 * 51_200,
    }
    assert sum(sizes.values()) == 6_284_955_622  # 6.3 GB to write at real size


def test_writer_writes_the_plan_and_every_file_loads(tmp_path):
    ms = reduced_set(SCALED_SET, dit_blocks=2, qwen_layers=2, vae_base_dim=8)
    info = write_model_folder(tmp_path / "models", ms)
    planned = planned_tensors(ms)
    for name, shapes in planned.items():
        sd = load_file(str(tmp_path / "models" / name))
        assert {k: tuple(v.shape) for k, v in sd.items()} == shapes, name
        assert {v.dtype for v in sd.values()} == {torch.bfloat16}, name
        assert _data_bytes(tmp_path / "models" / name) == planned_bytes(ms)[name], name
    g = ms.dit
    # Adapter files hold their factors in bf16 plus fp32 extras: SnapRef its two mode vectors (one weight a block),
    # ArcAnima one alpha per adapted linear.
    extras = {
        "snapref": 2 * g.num_blocks * 4,
        "arcanima-v2": g.num_blocks * 10 * 4,
        "arcanima-pilot": g.num_blocks * 10 * 4,
    }
    for kind, params in adapter_parameters(ms).items():
        assert _data_bytes(tmp_path / "models" / ADAPTER_FILES[kind]) == 2 * params + extras[kind], kind
    assert info["bytes"] == sum((tmp_path / "models" / n).stat().st_size for n in info["bytes_per_file"])

    checked = check_model_folder(tmp_path / "models", ms)
    assert checked["loaded"] is True
    assert set(checked["checked"]) == {*planned, *ADAPTER_FILES.values(), "tokenizers"}
    assert all("loads" in v for v in checked["checked"].values())


def test_check_names_the_file_and_the_tensor_that_differ(tmp_path):
    folder = write_model_folder(tmp_path / "models", TINY_SET)["folder"]
    vae = Path(folder) / VAE_FILE
    sd = load_file(str(vae))
    key = "decoder.head.2.weight"
    good = sd.pop(key)
    save_file(sd, str(vae))
    with pytest.raises(ValueError, match=rf"{vae}: differs from the plan: missing \['{key}'\]"):
        check_model_folder(folder, TINY_SET, load=False)
    sd[key] = good[:, :1].contiguous()
    save_file(sd, str(vae))
    with pytest.raises(ValueError, match=rf"{key} is \[3, 1, 3, 3, 3\], expected \[3, 8, 3, 3, 3\]"):
        check_model_folder(folder, TINY_SET, load=False)
    sd[key] = good.float()
    save_file(sd, str(vae))
    with pytest.raises(ValueError, match=r"1 tensors are not torch.bfloat16"):
        check_model_folder(folder, TINY_SET, load=False)


@pytest.mark.slow
def test_background_writer_hands_over_what_it_wrote_and_checked(tmp_path):
    writer = ModelFolderWriter(tmp_path / "models", TINY_SET, background=True)
    info = writer.wait()
    assert info["background"] is True and info["set"] == "tiny"
    assert info["check"]["loaded"] is True and (tmp_path / "models" / DIT_FILE).is_file()


def test_a_phase_whose_model_folder_failed_skips_every_run_and_says_why(tmp_path):
    (tmp_path / "models").write_text("a file where the folder should be")
    writer = ModelFolderWriter(tmp_path / "models", TINY_SET, background=False)  # fails, and says so at wait()
    with pytest.raises(RuntimeError, match=r"writing the model folder .* failed:\n(.|\n)*NotADirectoryError"):
        writer.wait()
    runs = tuple(parse_runs("snapref:bf16:eager,pilot:fp8:compiled"))
    cfg = PhaseConfig(runs=runs, recipe=SMOKE_RECIPE, device="cpu", deadline=time.perf_counter() + 60)
    e2e = run_phase(cfg, writer, tmp_path)
    assert e2e["runs"] == [] and e2e["error"].startswith("RuntimeError: writing the model folder")
    assert [s["run"] for s in e2e["skipped"]] == ["snapref:bf16:eager", "pilot:fp8:compiled"]
    assert all(s["why"].startswith("the phase did not start: RuntimeError") for s in e2e["skipped"])


# --- the runs and the budget ------------------------------------------------------------------------


def test_run_list_parses_in_order_and_errors_name_the_token():
    runs = parse_runs(DEFAULT_RUNS)
    assert ",".join(r.name for r in runs) == DEFAULT_RUNS
    assert [r.name for r in runs[:4]] == [
        "snapref:bf16:compiled",
        "snapref:bf16:eager",
        "snapref:fp8:compiled",
        "snapref:fp8:eager",
    ]
    assert {(r.kind, r.ref_guidance) for r in runs} == {
        ("snapref", None),
        ("arcanima-v2", 1.0),
        ("arcanima-pilot", None),
    }
    assert parse_runs("none") == [] and parse_runs("") == []
    for bad, message in (
        ("snapref:bf16", "'snapref:bf16' is not ADAPTER"),
        ("lora:bf16:eager", "adapter must be one of snapref, v2, pilot, found 'lora'"),
        ("v2:fp16:eager", "expected bf16|fp8 then eager|compiled"),
        ("v2-rgx:bf16:eager", "-rg must be followed by a number, found 'x'"),
        ("snapref:bf16:eager", "'snapref:bf16:eager' is listed twice"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_runs(f"snapref:bf16:eager,{bad}")
    with pytest.raises(ValueError, match="at least 2"):
        recipe_for(REAL_RECIPE, steps=1)
    assert recipe_for(REAL_RECIPE, images="1x3", steps=4).images == 3


def test_weighted_rows_follow_the_engine_plan():
    # SnapRef default: cond (reads) + uncond; v2 at rg 1 reads in both rows (its ref_in_uncond default);
    # SnapRef at rg 1.5 adds the cond row without the reference; the pilot at its defaults (rg 4.5): cond and
    # uncond read as two frames each, plus the plain cond row.
    weights = {
        name: run.weighted_rows()
        for name, run in zip(
            ("snapref", "v2-rg1", "snapref-rg1.5", "pilot"),
            parse_runs("snapref:bf16:eager,v2-rg1:bf16:eager,snapref-rg1.5:bf16:eager,pilot:bf16:eager"),
        )
    }
    assert weights == {"snapref": 2, "v2-rg1": 2, "snapref-rg1.5": 3, "pilot": 5}


def test_estimator_prefers_what_ran_and_falls_back_to_the_step_phases():
    snapref, pilot = RunSpec("snapref", None, "bf16", False), RunSpec("pilot", None, "bf16", False)
    snapref_c, fp8_c = RunSpec("snapref", None, "bf16", True), RunSpec("snapref", None, "fp8", True)
    recipe = recipe_for(REAL_RECIPE)  # 32 images x 30 steps
    est = RunEstimator(
        recipe, step_seconds={"eager": 0.8}, step_batch=4, compile_seconds_per_graph=None, startup_prior_s=45.0
    )
    # The step phase's 0.8 s for 4 images x 2 rows: 0.1 s a row-step; 32 x 30 x 2 rows of it + the prior start-up.
    assert est.estimate(snapref)[0] == pytest.approx(45 + 32 * 30 * 2 * 0.1)
    assert est.estimate(pilot)[0] == pytest.approx(45 + 32 * 30 * 5 * 0.1)
    # No compiled step measured: the eager one stands in, plus the prior start-up and 3 graphs of 90 s.
    assert est.estimate(snapref_c) == (
        pytest.approx(45 + 3 * 90 + 32 * 30 * 2 * 0.1),
        "sampling as the step phase's eager SnapRef step, start-up 45 s + 3 graphs x 90 s",
    )
    est.done.append(Done(snapref, wall_seconds=200.0, sampling_seconds=96.0, images=32, steps=30))
    # Finished: 96 s / (32 x 30 x 2) = 0.05 s a row-step, and 104 s besides sampling.
    assert est.estimate(pilot)[0] == pytest.approx(104 + 32 * 30 * 5 * 0.05)
    # A compiled run after an eager one (no compiled step measured): the eager run's sampling unit, the prior
    # start-up and 3 compiles.
    assert est.estimate(snapref_c)[0] == pytest.approx(45 + 3 * 90 + 32 * 30 * 2 * 0.05)
    est.done.append(Done(snapref_c, wall_seconds=400.0, sampling_seconds=48.0, images=32, steps=30))
    assert est.estimate(fp8_c)[0] == pytest.approx(352 + 48)  # the compiled run's fixed and sampling seconds
    steps_only = RunEstimator(
        recipe, step_seconds={"compiled": 0.4}, step_batch=4, compile_seconds_per_graph=70.0, startup_prior_s=30.0
    )
    seconds, basis = steps_only.estimate(snapref_c)
    assert seconds == pytest.approx(30 + 3 * 70 + 32 * 30 * 2 * 0.05) and "step phase's compiled" in basis


# --- the time breakdown -----------------------------------------------------------------------------


def _row(ref: str, batch: int, sample: float, decode: float, stream: float, upload: float) -> dict:
    return {
        "reference_hash": ref,
        "forward_batch": batch,
        "sample_s": sample,
        "decode_s": decode,
        "encode_s": stream,
        "upload_s": upload,
    }


def _call(call: str, finished_at: float, seconds: float, **timings: float) -> dict:
    return {"call": call, "pid": 7, "finished_at": finished_at, "seconds": seconds, **timings}


def test_time_breakdown_counts_each_forward_and_encode_once():
    # Reference a: one forward of 4 images (sample 8 s, decode 2 s), its encode 0.9 s of which the stream 0.5 s;
    # reference b: a forward of 2 (sample 5 s, decode 1 s), encoded in 1.1 s (stream 0.7 s). Each image's own
    # upload 0.25 s. The worker was ready at t = 105: the 1-step render before is its warm-up, the one after
    # the memory probe.
    rows = [_row("a", 4, 8.0, 2.0, 0.5, 0.25)] * 4 + [_row("b", 2, 5.0, 1.0, 0.7, 0.25)] * 2
    log = [
        _call("render", 100.0, 3.0, steps=1, images=1, text_s=0.1, sample_s=1.0),
        _call("encode", 108.0, 0.9, stream_s=0.5),
        _call("render", 110.0, 1.5, steps=1, images=1, text_s=0.1, sample_s=0.5),
        _call("render", 120.0, 10.6, steps=30, images=4, text_s=0.4, sample_s=8.0),
        _call("encode", 121.0, 1.1, stream_s=0.7),
        _call("render", 130.0, 6.3, steps=30, images=2, text_s=0.2, sample_s=5.0),
    ]
    summary = {"images_this_run": 6, "wall_seconds": 60.0, "startup_seconds": 30.0, "render_seconds": 28.0}
    out = time_breakdown(summary, rows, log, job_steps=30, png_seconds_per_image=0.1, ready_at={7: 105.0})
    expected = {
        "startup": 30.0,
        "dit_sampling": 13.0,
        "text_encoding": 0.6,
        "reference_encode": 2.0,
        "vae_decode": 3.0,
        "memory_probe": 1.5,
        "other_render": 28.0 - (13.0 + 0.6 + 2.0 + 3.0 + 1.5),
        "png_encode": 0.6,
        "storage": 1.5 - 0.6,
    }
    assert out["seconds"] == pytest.approx(expected)
    assert list(out["seconds"]) == list(SHARES)
    assert out["share_of_wall"] == pytest.approx({k: v / 60.0 for k, v in expected.items()})
    assert (out["warmup_seconds"], out["forwards"], out["reference_encodes"]) == (3.0, 2, 2)
    assert out["dit_sampling_seconds_from_call_log"] == pytest.approx(13.0)
    assert out["reference_stream_seconds"] == pytest.approx(1.2)
    assert out["row_encode_seconds"] == pytest.approx(sum(r["encode_s"] for r in rows))
    assert out["images_per_gpu_hour"] == pytest.approx(
        {"render": 3600 * 6 / 28.0, "wall": 3600 * 6 / 60.0, "dit_sampling_only": 3600 * 6 / 13.0}
    )
    with pytest.raises(ValueError, match="summary says 7 images this run, the metadata has 6 rows"):
        time_breakdown(
            {**summary, "images_this_run": 7}, rows, log, job_steps=30, png_seconds_per_image=0.1, ready_at={}
        )
    assert set(DEVICE_COMPONENTS) < set(SHARES)
