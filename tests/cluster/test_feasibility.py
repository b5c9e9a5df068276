"""The decision of cluster/feasibility.py on recorded autoscaler output: which report is about the workers' request,
what it names, and the one line the job ends with.

The live path (the pool stopping on Ray's own report, within seconds) runs in tests/test_cli_exit_codes.py, on the
session's local Ray: `--device cuda` there is a request no node can hold. Here, the autoscaler lines as Ray 2.60
prints them (v1, recorded from that run; v2 in the wording of ray/autoscaler/v2/event_logger.py) and a cluster
config of the kind the issue met: a GPU node type without the memory a worker asks for.
"""

from __future__ import annotations

import pytest

from snapref_ray import ray_console
from snapref_ray.cluster import feasibility
from snapref_ray.cluster.feasibility import (
    InfeasibilityWatch,
    WorkerCannotBePlaced,
    explain,
    infeasible_requests,
    is_this_request,
    node_type_offers,
)

# Recorded: `snapref-ray render ... --device cuda` on a local Ray of this machine (job.log, the autoscaler's line).
V1_LINE = (
    "2026-12-05 13:48:34,132\tINFO monitor.py:438 -- :event_summary:Error: No available node types can fulfill "
    "resource request {'memory': 3222315440.0, 'GPU': 1.0, 'CPU': 1.0}. Add suitable node types to this cluster "
    "to resolve this issue."
)
V2_LINE = (
    "No available node types can fulfill resource requests {'CPU': 1.0, 'GPU': 1.0, 'memory': 3222315440.0}*2, "
    "{'CPU': 4.0}*1. Add suitable node types to this cluster to resolve this issue."
)
WORKER = {"CPU": 1.0, "GPU": 1, "memory": 3222315440}
GIB = 2**30
CONFIG = {  # cluster.yaml's shape: the head and a GPU node type whose memory is 2 GiB
    "available_node_types": {
        "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
        "gpu": {"resources": {"CPU": 1, "GPU": 1, "memory": 2 * GIB}, "node_config": {}, "max_workers": 3},
    }
}


def test_both_wordings_parse_to_the_requests_they_name():
    assert infeasible_requests(V1_LINE) == [{"memory": 3222315440.0, "GPU": 1.0, "CPU": 1.0}]
    assert infeasible_requests(V2_LINE) == [{"CPU": 1.0, "GPU": 1.0, "memory": 3222315440.0}, {"CPU": 4.0}]
    assert infeasible_requests("Resized to 2 CPUs, 1 GPUs.") == []


def test_only_the_workers_own_request_counts():
    assert is_this_request(infeasible_requests(V1_LINE)[0], WORKER)
    assert not is_this_request({"CPU": 4.0}, WORKER)
    assert not is_this_request({"CPU": 1.0, "GPU": 1.0}, WORKER)  # someone else's actor, without memory=
    assert is_this_request({"CPU": 1.0, "GPU": 1.0}, {"CPU": 1, "GPU": 1, "memory": 0})  # no memory= asked


def test_the_line_names_the_resource_what_the_node_types_offer_and_what_to_change():
    offers = node_type_offers(CONFIG)
    assert offers == {"ray.head.default": {"CPU": 1.0}, "gpu": {"CPU": 1.0, "GPU": 1.0, "memory": 2.0 * GIB}}
    line = explain(WORKER, offers, source="the node types offer")
    assert line == (
        "a render worker can never start: it asks Ray for CPU 1, GPU 1, memory 3.00 GiB and no node type has enough"
        " memory (Ray's autoscaler: no available node type can fulfill it); the node types offer: ray.head.default:"
        " CPU 1; gpu: CPU 1, GPU 1, memory 2.00 GiB; lower cluster.memory_per_worker (or max_batch, or the image"
        " size), or give the cluster a node type that holds it (docs/clusters.md)"
    )
    no_gpu = explain(WORKER, {"cpu": {"CPU": 8.0, "memory": 64.0 * GIB}}, source="the nodes up now offer")
    assert "no node type has enough GPU" in no_gpu and "set model.device: cpu" in no_gpu


def test_the_watch_raises_on_the_autoscalers_report_of_the_workers_request_only(monkeypatch):
    monkeypatch.setattr(feasibility, "cluster_offers", lambda: (node_type_offers(CONFIG), "the node types offer"))
    other = "No available node types can fulfill resource requests {'CPU': 4.0}*1."
    watch = InfeasibilityWatch(WORKER)
    try:
        ray_console._on_output({"pid": "autoscaler", "lines": ["Resized to 2 CPUs.", other]})
        ray_console._on_output({"pid": 4242, "lines": [V1_LINE]})  # a worker printing it is not Ray's report
        watch.check()  # nothing about the workers' request from the autoscaler: keep waiting
        ray_console._on_output({"pid": "autoscaler", "lines": [V1_LINE]})
        with pytest.raises(WorkerCannotBePlaced, match="no node type has enough memory"):
            watch.check()
        assert watch.feed not in ray_console._listeners  # it stopped listening
    finally:
        watch.stop()
