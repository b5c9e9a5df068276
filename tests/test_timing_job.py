"""The timing-table job (snapref_ray/jobs/timing_table.py, jobs/timing_table.py) through Ray on the tiny models."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

import snapref_ray
from snapref_ray.eval_cli import add_eval_parsers, timing_spec_from_args
from snapref_ray.job_spec import OutputSpec
from snapref_ray.jobs.flop_model import Case, RowGroup, forward_flops, real_size_ratios
from snapref_ray.jobs.timing_catalogue import ARCANIMA_ROWS, SETTING_NAMES
from snapref_ray.jobs.timing_report import format_markdown
from snapref_ray.jobs.timing_settings import settings_to_time, timing_settings
from snapref_ray.jobs.timing_spec import TimingSpec
from snapref_ray.jobs.timing_table import run_timing
from snapref_ray.model_spec import LoRASpec, ModelSpec
from snapref_ray.tiny import TinyConfig, write_tiny_adapter

CASE = dict(width=256, height=256, steps=2, turbo_steps=2, sampler="euler", cfg=4.0)


@pytest.fixture(scope="module")
def ray_local(local_ray_job):
    """This module's job on the session's local Ray (tests/conftest.py)."""
    return local_ray_job


def spec_for(models: Path, out: Path, **kw) -> TimingSpec:
    return TimingSpec(
        model=ModelSpec(models_dir=str(models), device="cpu"),
        output=OutputSpec(uri=str(out)),
        **{**CASE, "repetitions": 2, "warmup": False, **kw},
    )


@pytest.fixture(scope="module")
def arcanima_files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("arc")
    return {
        kind: str(write_tiny_adapter(d / f"{kind}.safetensors", TinyConfig(), kind))
        for kind in ("arcanima-v2", "arcanima-pilot")
    }


@pytest.fixture(scope="module")
def table(ray_local, tiny_models, tmp_path_factory, arcanima_files):
    out = tmp_path_factory.mktemp("timing")
    summary = run_timing(
        spec_for(
            tiny_models,
            out,
            arcanima_v2_adapter=arcanima_files["arcanima-v2"],
            arcanima_pilot_adapter=arcanima_files["arcanima-pilot"],
        )
    )
    return out, summary


@pytest.fixture(scope="module")
def turbo_lora(tmp_path_factory) -> Path:
    """A ComfyUI-format LoRA on the tiny DiT's self-attention q/v projections (width 64)."""
    gen = torch.Generator().manual_seed(0)
    sd = {}
    for block in range(2):
        for name in ("self_attn.q_proj", "self_attn.v_proj"):
            sd[f"diffusion_model.blocks.{block}.{name}.lora_down.weight"] = torch.randn(4, 64, generator=gen) * 0.1
            sd[f"diffusion_model.blocks.{block}.{name}.lora_up.weight"] = torch.randn(64, 4, generator=gen) * 0.1
    path = tmp_path_factory.mktemp("lora") / "turbo.safetensors"
    save_file(sd, str(path))
    return path


# ---------------------------------------------------------------------------------------------
# Without Ray


def test_settings_cover_the_issue_list():
    spec = TimingSpec(model=ModelSpec(models_dir="m"), **CASE)
    settings = {s.name: s for s in timing_settings(spec)}
    # No ArcAnima files in models_dir "m": those rows are left out.
    assert list(settings) == [n for n in SETTING_NAMES if n not in ARCANIMA_ROWS]
    assert not settings["no_reference"].reference
    assert all(s.reference for name, s in settings.items() if name != "no_reference")
    assert settings["ref_in_uncond"].settings.ref_in_uncond
    guided = settings["ref_guidance_apg"].settings
    assert (guided.ref_guidance, guided.correction) == (4.5, "apg")
    assert (settings["ref_end_0.6"].settings.ref_end, settings["ref_end_0.6"].settings.ref_guidance) == (0.6, 4.5)
    assert settings["recompute_every_step"].settings.recompute_reference_every_step
    turbo = settings["turbo"]
    assert (turbo.settings.steps, turbo.settings.cfg, turbo.turbo) == (2, 1.0, False)
    assert "on the base model: no turbo LoRA given" in turbo.label
    only = timing_settings(spec.model_copy(update={"settings": ["turbo"]}))
    assert [s.name for s in only] == ["no_reference", "turbo"]  # the ratios' denominator always runs


def test_arcanima_rows_run_their_own_adapter_at_its_defaults():
    spec = TimingSpec(
        model=ModelSpec(models_dir="m"),
        arcanima_v2_adapter="v2.safetensors",
        arcanima_pilot_adapter="p.safetensors",
        **CASE,
    )
    settings = {s.name: s for s in timing_settings(spec)}
    assert list(settings) == list(SETTING_NAMES)
    for name, kind in ARCANIMA_ROWS.items():
        assert settings[name].adapter_kind == kind and settings[name].reference
    assert settings["arcanima_v2"].settings.ref_guidance is None  # unset: the kind's own default (4.5 + APG)
    assert settings["arcanima_pilot_rg1"].settings.ref_guidance == 1.0


@pytest.mark.parametrize("kind", ["arcanima-v2", "arcanima-pilot", None])
def test_rows_follow_the_adapter_kinds_the_model_has(kind):
    """A model whose adapter is an ArcAnima file (what `make-tiny --adapter-kind` writes) runs that kind's rows
    and says why the SnapRef rows are left out; without an adapter only the plain row runs."""
    spec = TimingSpec(model=ModelSpec(models_dir="m", adapter=f"{kind}.safetensors" if kind else None), **CASE)
    settings, left_out = settings_to_time(spec, kind)
    runs = {s.name for s in settings}
    snapref_rows = {n for n in SETTING_NAMES if n not in ARCANIMA_ROWS and n != "no_reference"}
    own = {n for n, k in ARCANIMA_ROWS.items() if k == kind}
    assert runs == {"no_reference", *own}
    assert set(left_out) == set(SETTING_NAMES) - runs
    why = "the model has no reference adapter" if kind is None else f"the model's adapter is an {kind} file"
    assert all(left_out[n] == f"a SnapRef row: {why}" for n in snapref_rows)
    other = {n for n in ARCANIMA_ROWS if n not in own}
    assert all(left_out[n].startswith("needs an arcanima-") for n in other)
    if kind:
        assert all(s.adapter_kind == kind for s in settings if s.reference)
        assert spec.arcanima_adapters(kind) == {kind: f"{kind}.safetensors"}


def test_flop_model_matches_the_benchmarks_and_the_expected_ratios():
    from benchmarks.common import REAL
    from snapref_ray.models.flops import dit_forward_flops

    config = REAL.config
    # The same counting as the benchmarks' model, with and without a reference read and a LoRA.
    assert forward_flops(config, RowGroup(2, 3952)) == dit_forward_flops(config, rows=2, tokens=3952, context_rows=512)
    ranks = {"self_attn.q_proj": 64}
    assert forward_flops(config, RowGroup(1, 3952, 4096, tuple(ranks.items()))) == dit_forward_flops(
        config, rows=1, tokens=3952, context_rows=512, reading_rows=1, ref_tokens=4096, lora_ranks=ranks
    )
    r = real_size_ratios(
        {
            "no_reference": 0,
            "snapref_default": 0,
            "arcanima_v2_rg1": 0,
            "arcanima_v2": 1,
            "arcanima_pilot_rg1": 0,
            "arcanima_pilot": 1,
        },
        steps=28,
    )
    assert r["no_reference"] == 1.0
    assert 1.0 < r["snapref_default"] < r["arcanima_v2_rg1"] < r["arcanima_pilot_rg1"]
    assert r["arcanima_v2"] == pytest.approx(r["arcanima_v2_rg1"] + 0.5)  # the extra call is one plain row of two
    # The pilot's two-frame rows: twice the tokens, so more than twice the attention of a plain row.
    assert r["arcanima_pilot_rg1"] > 2.0
    assert Case().tokens == 3952


def test_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="unknown setting\\(s\\) fastest; known: no_reference"):
        TimingSpec(model=ModelSpec(models_dir="m"), settings=["fastest"])


def test_cli_quick_form_maps_onto_the_spec(tmp_path):
    parser = argparse.ArgumentParser()
    add_eval_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "timing",
            "--models",
            str(tmp_path),
            "--width",
            "256",
            "--height",
            "320",
            "--steps",
            "3",
            "--repetitions",
            "5",
            "--turbo-lora",
            f"{tmp_path}/t.safetensors:0.8",
            "--settings",
            "snapref_default,turbo",
            "--out",
            str(tmp_path / "o"),
            "--no-warmup",
        ]
    )
    spec = timing_spec_from_args(args)
    assert (spec.width, spec.height, spec.steps, spec.repetitions, spec.warmup) == (256, 320, 3, 5, False)
    assert spec.turbo_lora == LoRASpec(path=f"{tmp_path}/t.safetensors", strength=0.8)
    assert spec.settings == ["snapref_default", "turbo"]
    assert spec.reference_uri() == f"{tmp_path}/reference.png"
    assert spec.output.uri == str(tmp_path / "o")


# ---------------------------------------------------------------------------------------------
# Through Ray


@pytest.mark.slow
def test_table_has_every_setting_and_ratios_from_the_measured_times(table, tiny_renderer, tiny_models):
    out, summary = table
    saved = json.loads((out / "comparison_summary.json").read_text())
    assert saved["settings"] == json.loads(json.dumps(summary["settings"]))
    rows = {r["name"]: r for r in saved["settings"]}
    assert list(rows) == list(SETTING_NAMES)
    base = rows["no_reference"]
    assert saved["environment"]["arcanima_adapters"].keys() == {"arcanima-v2", "arcanima-pilot"}
    assert (
        rows["arcanima_v2"]["ref_guidance_step_share"] == 1.0
        and rows["arcanima_v2_rg1"]["ref_guidance_step_share"] == 0
    )
    for r in rows.values():
        assert r["flop_step_ratio_832x1216"] >= (1.0 if r["name"] != "turbo" else 0.4)
    for r in rows.values():
        assert len(r["runs"]) == 2
        assert r["seconds_per_image"] > 0 and r["seconds_per_step"] > 0
        assert r["ratio_to_no_reference"] == r["seconds_per_image"] / base["seconds_per_image"]
        assert r["step_ratio_to_no_reference"] == r["seconds_per_step"] / base["seconds_per_step"]
        assert r["cpu_step_ratio_to_no_reference"] == r["cpu_seconds_per_step"] / base["cpu_seconds_per_step"]
        assert r["cpu_seconds_per_step"] == statistics.median(m["cpu_seconds_per_step"] for m in r["runs"]) > 0
        # the reported figures are the medians of the measured runs
        assert r["seconds_per_image"] == statistics.median(m["seconds_per_image"] for m in r["runs"])
        assert r["seconds_per_step"] == statistics.median(m["sample_s"] / m["steps"] for m in r["runs"])
    assert base["ratio_to_no_reference"] == 1.0
    kv = tiny_renderer.encode_reference((tiny_models / "reference.png").read_bytes(), width=256, height=256)
    for name in ("snapref_default", "ref_in_uncond", "ref_guidance_apg", "ref_end_0.6", "turbo", "step_cache"):
        assert rows[name]["refkv_bytes"] == kv.nbytes
        assert rows[name]["encode_seconds"] > 0
    for name in ("no_reference", "recompute_every_step"):
        assert rows[name]["refkv_bytes"] is None and rows[name]["encode_seconds"] is None
    assert rows["arcanima_pilot"]["refkv_bytes"] == 16 * 32 * 32 * 4  # the reference latent at the output size
    assert rows["arcanima_v2"]["refkv_bytes"] > 0 and rows["arcanima_v2"]["encode_seconds"] > 0
    assert rows["turbo"]["settings"]["steps"] == 2 and rows["turbo"]["settings"]["cfg"] == 1.0
    # only the step-cache row runs with the cache, and it counts the forwards its image skipped
    assert rows["step_cache"]["settings"]["step_cache"]["threshold"] == 0.2
    assert 0 <= rows["step_cache"]["skipped_forwards"] < rows["step_cache"]["settings"]["steps"]
    assert all(r["skipped_forwards"] is None for n, r in rows.items() if n != "step_cache")
    env = saved["environment"]
    assert (env["device"], env["dtype"]) == ("cpu", "float32")
    assert (env["torch"], env["snapref_ray"]) == (torch.__version__, snapref_ray.__version__)
    assert env["ray"] and env["model"]["num_blocks"] == 2 and env["adapter"].startswith("sha256:")
    assert "RSS" in saved["memory_metric"]
    assert saved["case"]["reference_size"] == [128, 192]


@pytest.mark.slow
def test_markdown_table_matches_the_json(table):
    out, summary = table
    md = (out / "comparison_summary.md").read_text()
    assert md == format_markdown(summary)
    assert "**CPU figures**" in md and "peak RSS delta (CPU)" in md
    lines = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| setting")]
    assert len(lines) == len(SETTING_NAMES)
    for line, row in zip(lines, summary["settings"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == row["label"]
        assert cells[3] == f"{row['ratio_to_no_reference']:.2f}"
        assert cells[4] == f"{row['step_ratio_to_no_reference']:.2f}"
        assert cells[9] == f"{row['cpu_step_ratio_to_no_reference']:.2f}"
        skipped = row["skipped_forwards"]
        assert cells[11] == ("-" if skipped is None else f"{skipped}/{summary['case']['steps']}")


@pytest.mark.slow
def test_turbo_row_merges_the_given_lora(ray_local, tiny_models, turbo_lora, tmp_path):
    from jobs.timing_table import main

    spec = {
        "model": {"models_dir": str(tiny_models), "device": "cpu"},
        **CASE,
        "repetitions": 1,
        "warmup": False,
        "settings": ["turbo"],
        "turbo_lora": {"path": str(turbo_lora), "strength": 0.5},
        "output": {"uri": "out"},
    }
    (tmp_path / "timing.yaml").write_text(yaml.safe_dump(spec))
    assert main([str(tmp_path / "timing.yaml")]) == 0
    saved = json.loads((tmp_path / "out" / "comparison_summary.json").read_text())
    rows = {r["name"]: r for r in saved["settings"]}
    assert list(rows) == ["no_reference", "turbo"]
    assert rows["turbo"]["turbo_lora_merged"] is True
    assert rows["turbo"]["label"] == "turbo: LoRA turbo.safetensors x0.5 merged, 2 steps, cfg 1"
    assert saved["environment"]["turbo_model"] == "dit.safetensors+1 LoRA"
    assert saved["turbo_lora"] == {"path": str(turbo_lora), "strength": 0.5}
