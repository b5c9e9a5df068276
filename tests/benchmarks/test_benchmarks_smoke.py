"""The benchmark scripts run end to end (tiny sizes, `--smoke`) and print every documented field.

No timing thresholds: the figures themselves are for the README, not for CI. What is checked is
that each script runs its real code path, that the JSON carries every field the README documents
with positive numbers, and that the FLOP model the GFLOP/s figures rest on counts what torch runs.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import dit_forward, snapref_steps
from benchmarks.common import (
    REAL,
    SCALED,
    build_dit,
    interleaved,
    paired_ratio,
)
from snapref_ray.models.attention import RefRead
from snapref_ray.models.dit_config import real_dit_config
from snapref_ray.models.flops import block_linear_dims, dit_forward_flop_breakdown, dit_forward_flops
from snapref_ray.models.ops import LoRAPair

# Counts that are legitimately zero (the no-reference step reads nothing).
ZERO_ALLOWED = ("reading_rows",)


def _assert_positive_numbers(value, where: str) -> None:
    """Every number in a record is finite and > 0 (booleans and strings are not numbers here)."""
    if isinstance(value, bool) or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        if where.rsplit(".", 1)[-1] in ZERO_ALLOWED:
            assert value >= 0, f"{where} = {value!r}, expected a count"
        else:
            assert math.isfinite(value) and value > 0, f"{where} = {value!r}, expected a positive number"
    elif isinstance(value, dict):
        for k, v in value.items():
            _assert_positive_numbers(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _assert_positive_numbers(v, f"{where}[{i}]")


def test_dit_forward_smoke_prints_every_field(capsys):
    records = dit_forward.main(["--smoke"])

    assert [r["case"] for r in records] == ["real_arch", "width_scaled"]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == json.loads(json.dumps(printed))  # one JSON object per line, nothing else on stdout
    assert [p["case"] for p in printed] == ["real_arch", "width_scaled"]
    for record in printed:
        fields = dit_forward.FIELDS + dit_forward.CPU_FIELDS
        assert set(fields) <= set(record), set(fields) - set(record)
        assert not set(dit_forward.CUDA_FIELDS) & set(record)  # % of peak only on a GPU
        assert record["blocks_measured"] == record["blocks"] and record["extrapolated"] is False
        assert record["environment"]["device"] == "cpu"
        _assert_positive_numbers({k: record[k] for k in fields if k != "environment"}, record["case"])


def test_dit_forward_smoke_fewer_blocks_extrapolates(capsys):
    (record,) = dit_forward.main(["--smoke", "--case", "real_arch", "--blocks", "1"])

    assert (record["blocks"], record["blocks_measured"], record["extrapolated"]) == (2, 1, True)
    # Times are scaled to the full block count by the FLOP ratio of the two configs.
    geometry = dit_forward.SMOKE.with_size(32, 32)
    shape = dict(rows=1, tokens=geometry.tokens, context_rows=geometry.context_rows)
    ratio = dit_forward_flops(geometry.config, **shape) / dit_forward_flops(geometry.with_blocks(1).config, **shape)
    assert record["seconds_per_forward"] == pytest.approx(record["measured_seconds_per_forward"] * ratio, rel=1e-4)
    _assert_positive_numbers({k: record[k] for k in dit_forward.FIELDS if k != "environment"}, "real_arch")


def test_snapref_steps_smoke_prints_every_field(capsys):
    table = snapref_steps.main(["--smoke", "--compact", "--profile", "--profile-top", "3"])

    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(table))
    assert set(snapref_steps.FIELDS) <= set(table), set(snapref_steps.FIELDS) - set(table)
    assert list(table["settings"]) == list(snapref_steps.SETTINGS)
    for name, setting in table["settings"].items():
        missing = set(snapref_steps.SETTING_FIELDS + snapref_steps.CPU_SETTING_FIELDS) - set(setting)
        assert not missing, (name, missing)
    for name, target in table["targets"].items():
        assert set(snapref_steps.TARGET_FIELDS + snapref_steps.CPU_TARGET_FIELDS) <= set(target), name
        assert isinstance(target["met"], bool)
    _assert_positive_numbers({k: table[k] for k in snapref_steps.FIELDS if k != "environment"}, "table")
    # Rows and reads per setting are the engine's plan (docs/design.md#which-rows-read-and-reference-guidance).
    plans = {name: (s["rows"], s["reading_rows"]) for name, s in table["settings"].items()}
    assert plans == {
        "no_reference": (2, 0),
        "snapref_default": (2, 1),
        "ref_in_uncond": (2, 2),
        "ref_guidance": (3, 2),
        "recompute_every_step": (2, 1),
        "char_mode": (2, 1),
    }
    assert table["settings"]["no_reference"]["ratio_to_no_reference"] == 1.0
    assert table["settings"]["no_reference"]["flop_ratio_to_no_reference"] == 1.0
    # RefKV at the smoke geometry: 2 blocks x (K, V) x 64 wide x 16 reference tokens, fp32.
    assert table["refkv_bytes"] == 2 * 2 * 64 * 16 * 4
    assert list(table["profile"]) == list(snapref_steps.SETTINGS)


def test_snapref_steps_cached_step_equals_recompute_step():
    """The benchmark's recompute step is the same computation as its cached step, only re-encoded."""
    bench = snapref_steps.StepBench(snapref_steps.GEOMETRIES["smoke"], torch.device("cpu"), torch.float32)
    cached = bench.step_fn("snapref_default")()
    recomputed = bench.step_fn("recompute_every_step")()
    no_reference = bench.step_fn("no_reference")()
    assert torch.equal(cached, recomputed)
    assert (cached - no_reference).abs().max() > 1e-3  # the reference is really read


def _tiny_dit():
    return build_dit(dit_forward.SMOKE.with_blocks(2), device=torch.device("cpu"), dtype=torch.float32)


def test_flop_model_linear_part_equals_torch_flop_counter():
    # FlopCounterMode counts matmuls (mm/addmm/bmm) but not the CPU flash-attention op: compare the
    # linear part exactly, and the attention part against its formula.
    dit = _tiny_dit()
    config = dit.config
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, 1, 12, 10, generator=gen)
    ctx = torch.randn(3, 7, config.context_dim, generator=gen)
    rk, rv = torch.randn(2, 9, 32, generator=gen), torch.randn(2, 9, 32, generator=gen)
    refs = [RefRead(rk, rv, torch.tensor([True, False, True]), 1.0)] * 2
    dims = block_linear_dims(config)
    lora = {
        "self_attn.q_proj": LoRAPair(
            torch.randn(4, dims["self_attn.q_proj"][0]), torch.randn(dims["self_attn.q_proj"][1], 4), 1.0
        ),
        "cross_attn.k_proj": LoRAPair(
            torch.randn(5, dims["cross_attn.k_proj"][0]), torch.randn(dims["cross_attn.k_proj"][1], 5), 1.0
        ),
    }
    ranks = {"self_attn.q_proj": 4, "cross_attn.k_proj": 5}
    with FlopCounterMode(display=False) as counter:
        dit(x, torch.full((3,), 0.5), ctx, loras=[lora, lora], refs=refs)
    split = dit_forward_flop_breakdown(
        config, rows=3, tokens=30, context_rows=7, reading_rows=2, ref_tokens=9, lora_ranks=ranks
    )
    assert split["linear"] == counter.get_total_flops()
    inner, L = config.num_heads * config.head_dim, 30
    assert split["attention"] == 2 * (4 * L * (3 * L + 2 * 9) * inner + 4 * L * 7 * inner * 3)

    with FlopCounterMode(display=False) as counter:
        dit.reference_kv(x[:1], ctx[:1], loras=[lora, lora])
    split = dit_forward_flop_breakdown(config, rows=1, tokens=30, context_rows=7, lora_ranks=ranks, final_layer=False)
    assert split["linear"] == counter.get_total_flops()


def test_flop_model_real_size_ratios_match_the_issue():
    # The FLOP floors (docs/design.md#performance-targets) at 832x1216 with a 1 MP reference:
    # SnapRef ~1.11x, recompute ~1.5x, ref_guidance ~1.55x.
    config = real_dit_config(28)
    f = lambda **k: dit_forward_flops(config, tokens=3952, context_rows=512, **k)  # noqa: E731
    no_ref = f(rows=2)
    default = f(rows=2, reading_rows=1, ref_tokens=4096, lora_ranks={"self_attn.q_proj": 64})
    guided = f(rows=3, reading_rows=2, ref_tokens=4096, lora_ranks={"self_attn.q_proj": 64})
    stream = dit_forward_flops(
        config,
        rows=1,
        tokens=4096,
        context_rows=512,
        lora_ranks={p: 128 for p in block_linear_dims(config)},
        final_layer=False,
    )
    assert default / no_ref == pytest.approx(1.1115, abs=5e-4)
    assert guided / default == pytest.approx(1.5487, abs=5e-4)
    assert (default + stream) / default == pytest.approx(1.5049, abs=5e-4)
    # The width-scaled geometry divides every length by 4, so every FLOP term by exactly 64.
    assert dit_forward_flops(
        SCALED.config, rows=2, tokens=SCALED.tokens, context_rows=SCALED.context_rows
    ) * 64 == pytest.approx(
        dit_forward_flops(REAL.config, rows=2, tokens=REAL.tokens, context_rows=REAL.context_rows), rel=2e-3
    )


def test_interleaved_rotates_the_order_and_drops_warmup():
    calls = []
    cases = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = interleaved(cases, torch.device("cpu"), rounds=3, warmup_rounds=1)
    assert calls == list("abcbcacababc")
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert paired_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]) == 2.0


@pytest.mark.slow
def test_orchestration_smoke_measures_busy_fraction_with_and_without_overlap(capsys):
    """Real Ray, real PNG encoding, real uploads to a SeaweedFS S3 server, both output modes."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "orchestration", Path(__file__).parents[2] / "benchmarks" / "orchestration.py"
    )
    orchestration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(orchestration)
    result = orchestration.main(["--smoke"])

    assert json.loads(capsys.readouterr().out) == result
    assert [(r["output_overlap"], r["output"]) for r in result["runs"]] == [(True, "s3"), (False, "s3")]
    for run in result["runs"]:
        assert run["images"] == run["references"] * 8 and run["max_encodes_per_reference"] == 1
        assert 0 < run["workers_busy"] <= 1
    (overlap,) = result["overlap"]
    assert set(overlap) == {
        "workers",
        "prompts_per_reference",
        "workers_busy_with_overlap",
        "workers_busy_without_overlap",
        "images_per_s_with_overlap",
        "images_per_s_without_overlap",
    }


@pytest.mark.slow
def test_attention_forms_smoke_agree_and_report_every_form(capsys):
    from benchmarks import attention_forms

    table = attention_forms.main(["--smoke"])
    assert json.loads(capsys.readouterr().out) == table
    assert set(attention_forms.FIELDS) <= set(table)
    assert list(table["settings"]) == list(attention_forms.SETTINGS)
    for name, setting in table["settings"].items():
        assert set(attention_forms.SETTING_FIELDS) <= set(setting), name
        assert set(setting["seconds"]) == {"lse", "flex", "concat"}
        assert max(setting["max_abs_diff_to_concat"].values()) < 1e-5, name  # the forms compute one thing
