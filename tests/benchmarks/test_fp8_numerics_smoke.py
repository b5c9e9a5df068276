"""benchmarks/fp8_numerics.py runs end to end at tiny sizes and prints every documented field (no timings checked)."""

from __future__ import annotations

import json
import math

from benchmarks import fp8_numerics


def test_fp8_numerics_smoke_prints_every_case_and_field(capsys):
    records = fp8_numerics.main(["--smoke"])

    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == records
    assert [r["case"] for r in printed] == ["linear", "tiny_render", "step_time"]
    linear, render, step = printed
    for errors in linear["relative_error_vs_float64"].values():
        # Both paths really ran and fp8 is the coarser one: e4m3 keeps 4 significant bits, bf16 8.
        assert 0 < errors["bf16"] < errors["fp8"] < 0.1
    assert 0 < render["latent_relative_error"] < 0.2 and math.isfinite(render["image_psnr_db"])
    assert set(step["seconds_per_step"]) == {"bf16", "fp8"} and all(s > 0 for s in step["seconds_per_step"].values())
    assert step["fp8_over_bf16"] > 0 and 0 < step["fp8_velocity_relative_error_vs_bf16"] < 0.2
