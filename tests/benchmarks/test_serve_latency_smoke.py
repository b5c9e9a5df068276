"""benchmarks/serve_latency.py --smoke runs end to end (a real local Serve, tiny models) and prints
every section the benchmarks README reads. No timing thresholds: only that each figure exists and
is a real measurement (positive, finite, counts that add up).

It runs in this process on the session's local Serve (tests/conftest.py), which it deploys its
applications on in turn, as it does on the Serve it starts when run as a script."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch


def _latency(record: dict, where: str) -> None:
    assert record["n"] >= 1, where
    for key in ("p50_ms", "p95_ms"):
        assert math.isfinite(record[key]) and record[key] > 0, (where, record)


@pytest.mark.slow
def test_serve_latency_smoke_prints_every_section(local_serve, tmp_path: Path, capsys) -> None:
    from benchmarks import serve_latency
    from snapref_ray.serve.direct_ingress import haproxy_binary

    if haproxy_binary() is None:
        pytest.skip("haproxy is not installed (apt-get install haproxy): the benchmark measures the server behind it")

    out = tmp_path / "serve.json"
    threads = torch.get_num_threads()  # the benchmark's in-process Renderer runs on one thread, as a replica
    try:
        returned = serve_latency.main(["--smoke", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out)  # stdout is the JSON alone
    assert result == json.loads(out.read_text()) == json.loads(json.dumps(returned))
    assert result["smoke"] is True and set(serve_latency.FIELDS) <= set(result)
    # The server's defaults for one replica, measured: HAProxy's front door, an ingress that renders itself.
    assert (result["front"], result["topology"]) == ("haproxy", "fused")
    for section in ("low_load", "low_load_10ms_batch_window"):
        low = result[section]
        _latency(low["http"], section)
        _latency(low["in_process"], section)
        _latency(low["health_floor"], section)
        assert low["http"]["n"] == low["in_process"]["n"] == serve_latency.SMOKE["rounds"]
        assert math.isfinite(low["overhead_vs_in_process_p50_ms"]) and math.isfinite(low["overhead_measured_p50_ms"])
        _latency(low["overhead_measured"], section)  # per request: latency minus the replica's own work
    _latency(result["concurrent"], "concurrent")
    assert result["concurrent"]["requests_per_s"] > 0 and result["concurrent"]["mean_batch_size"] >= 1
    for key in ("miss", "hit", "replica_encode", "in_process_encode"):
        _latency(result["cache"][key], key)
    overload = result["overload"]
    assert overload["ok"] >= 1 and overload["ok"] + overload["rejected_503"] == serve_latency.SMOKE["burst"]
    assert result["environment"]["device"] == "cpu"
    for hops in ("one_hop", "two_hops"):
        _latency(result["serve_floor"][hops], hops)
