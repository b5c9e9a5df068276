"""benchmarks/vae_memory.py runs end to end (`--smoke`: tiny sizes) and prints every documented field."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import vae_memory


@pytest.mark.slow
def test_vae_memory_smoke_prints_every_field(capsys, monkeypatch, tmp_path):
    # A PYTHONPATH that names only some other folder: the measurement children still import this tree.
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    records = vae_memory.main(["--smoke"])

    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["case"] for p in printed] == [r["case"] for r in records] == list(vae_memory.CASES)
    for record in printed[:2]:
        assert set(vae_memory.MEMORY_FIELDS) <= set(record), set(vae_memory.MEMORY_FIELDS) - set(record)
        assert record["batches"] == [1, 4]
        one, four = record["peak_rss_bytes"]
        assert 0 < record["rss_before_bytes"][0] < one and record["ratio"] == pytest.approx(four / one, rel=1e-4)
        assert record["met"] == (record["ratio"] <= vae_memory.TARGET_RATIO)
        # The plan each child ran, as the VAE logged it (one line per decode call).
        assert record["vae_plans"]["4"][0].startswith("VAE decode of 4 x ")
        assert record["estimated_one_image_decode_peak_bytes"] > 0
    tiling = printed[2]
    assert set(vae_memory.TILING_FIELDS) <= set(tiling)
    assert [row["overlap"] for row in tiling["rows"]] == [2, 6]
    for row in tiling["rows"]:
        for design in ("ours", "whole_network"):
            assert math.isfinite(row[design]["max_abs_255"]) and 0 <= row[design]["uint8_differ_fraction"] <= 1
