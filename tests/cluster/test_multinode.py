"""Batch jobs on a real multi-node cluster: Ray's autoscaler adds GPU nodes (fake_multinode provider,
benchmarks/fake_cluster.py) for the job's GPU workers; the workers run the tiny models on CPU.

The session's fake cluster (tests/conftest.py: a head with 2 CPUs and no GPU, at most 3 autoscaled
nodes with 1 CPU and `GPU: 1` each), cold when the module starts (the head alone); the tests run in
file order and each waits for what it needs.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
import ray
from PIL import Image

from benchmarks.fake_cluster import FakeCluster
from snapref_ray.jobs.generate_dataset import run_job
from snapref_ray.storage.backends import open_storage
from snapref_ray.storage.metadata import read_item_ids, read_metadata_table
from tests.cluster.conftest import expected_item_ids, job_spec, make_reference_png, write_manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["1girl, city", "1girl, beach", "1girl, forest", "1girl, snow", "1girl, rain", "1girl, cafe"]


@pytest.fixture(scope="module")
def cluster(shared_fake_cluster) -> FakeCluster:
    # Cold: the first test starts a job on a cluster without GPU nodes. The session's cluster runs the
    # dashboard, which hosts the job server that `ray job submit` talks to.
    with shared_fake_cluster(max_gpu_nodes=3, cold=True) as c:
        yield c


def _manifest(folder: Path, references: int, prompts: int) -> Path:
    rows = []
    for r in range(references):
        ref = make_reference_png(folder / "refs" / f"ref{r}.png", (50 * r % 256, 100, 220 - 40 * r))
        rows += [
            {"reference": ref.relative_to(folder).as_posix(), "prompt": p, "seed": 100 * r + i}
            for i, p in enumerate(PROMPTS[:prompts])
        ]
    return write_manifest(folder / "manifest.csv", rows)


def _cluster_spec(manifest: Path, models: Path, out: Path, cluster: FakeCluster, **shape):
    """device auto on a cluster: every worker asks for num_gpus=1 (the fake nodes have GPU: 1 and
    no CUDA, so the tiny models run on CPU there)."""
    return job_spec(
        manifest,
        models,
        str(out),
        defaults={"steps": 3},
        model={"device": "auto"},
        cluster={"address": cluster.address, "num_workers": None, "max_batch": 1, **shape},
    )


def _exactly_once(out: Path, expected: set[str]) -> pd.DataFrame:
    storage = open_storage(str(out))
    ids = read_item_ids(storage)
    assert len(ids) == len(set(ids)), f"duplicated items: {[i for i, n in Counter(ids).items() if n > 1]}"
    assert set(ids) == expected
    frame = read_metadata_table(storage).to_pandas()
    for key in frame["image_key"]:
        Image.open(io.BytesIO(storage.get_bytes(key))).load()  # every committed image exists and decodes
    return frame


def _wait_for_alive_workers(cluster: FakeCluster, count: int, timeout_s: float) -> None:
    """Until `count` RenderWorker actors of the cluster have finished starting (Ray's state API, asked of
    this cluster's dashboard by address: the other lane's Ray runs on this machine too)."""
    from ray.util.state import list_actors

    deadline = time.monotonic() + timeout_s
    filters = [("class_name", "=", "RenderWorker"), ("state", "=", "ALIVE")]
    while len(list_actors(address=cluster.dashboard_url, filters=filters)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} workers alive after {timeout_s:.0f} s"
        time.sleep(0.5)


def test_job_on_a_cold_cluster_gets_gpu_nodes_and_later_workers_join(cluster, tiny_models, tmp_path):
    assert cluster.gpu_node_ids() == []  # only the head: no GPU anywhere yet
    spec = _cluster_spec(
        _manifest(tmp_path, references=4, prompts=6),
        tiny_models,
        tmp_path / "out",
        cluster,
        min_workers=1,
        max_workers=3,
    )
    joins: list[tuple[float, str]] = []  # (time, node_id) of each worker joining the schedule
    first_commit: list[float] = []

    def committed(n: int) -> None:
        if first_commit:
            return
        first_commit.append(time.monotonic())
        # Now the autoscaler may bring the other two nodes. The driver waits here until their workers have
        # started, so that they join while most of the job is left: on an idle machine the first worker
        # renders the whole job in less time than a node takes to boot.
        cluster.set_gpu_node_limit(3)
        _wait_for_alive_workers(cluster, 3, timeout_s=180)

    # One GPU node until the first image, then three. With all three launched at once, their workers once
    # joined within half a second of each other, before the first image: whether a worker joined a job
    # that was already rendering depended on how fast this machine started nodes, not on the scheduler.
    cluster.set_gpu_node_limit(1)
    try:
        summary = run_job(
            spec,
            progress=False,
            write_gallery=False,
            on_workers=lambda handles, infos: joins.extend((time.monotonic(), i.node_id) for i in infos),
            on_progress=committed,
        )
    finally:
        cluster.set_gpu_node_limit(3)

    frame = _exactly_once(tmp_path / "out", expected_item_ids(spec))
    assert (summary.images_this_run, summary.failed_items) == (24, 0)
    nodes = set(frame["node_id"])
    assert len(nodes) >= 2, f"all images from one node: {nodes}"
    assert nodes <= set(cluster.gpu_node_ids()) | {n for _, n in joins}
    assert cluster.raylet_pids().keys() >= nodes  # real, separate raylets
    assert len(cluster.log_monitor_pids()) == 1  # one per host: the GPU nodes share the head's logs folder
    # Rendering started with the first worker; workers that joined after it rendered too.
    late = {node for t, node in joins if t > first_commit[0]}
    assert late, f"every worker joined before the first image: {joins}, first image at {first_commit[0]}"
    assert late & nodes, f"late workers on {late} rendered nothing ({Counter(frame['node_id'])})"
    assert summary.images_per_node == dict(Counter(frame["node_id"]))
    assert summary.peak_workers >= 2
    assert summary.scheduler["workers_started"] == len(joins)


def test_whole_node_killed_mid_job_loses_and_duplicates_nothing(cluster, tiny_models, tmp_path):
    spec = _cluster_spec(
        _manifest(tmp_path, references=3, prompts=6),
        tiny_models,
        tmp_path / "out",
        cluster,
        min_workers=2,
        max_workers=2,
    )
    infos_seen = []
    committed = threading.Event()
    killed: dict[str, object] = {}

    def kill_a_node() -> None:
        if not committed.wait(300):
            return
        node = infos_seen[0].node_id
        killed["node"], killed["pid"] = node, cluster.kill_node(node)
        killed["at"] = time.time()

    killer = threading.Thread(target=kill_a_node, daemon=True)
    killer.start()
    summary = run_job(
        spec,
        progress=False,
        write_gallery=False,
        on_workers=lambda handles, infos: infos_seen.extend(infos),
        on_progress=lambda n: len(infos_seen) >= 2 and committed.set(),
    )
    killer.join(timeout=60)
    assert "pid" in killed, "the node was never killed"
    assert killed["node"] not in cluster.raylet_pids()  # it is gone for good
    frame = _exactly_once(tmp_path / "out", expected_item_ids(spec))
    assert (summary.images_this_run, summary.failed_items) == (18, 0)
    after = frame[frame["finished_at"] > killed["at"]]
    assert len(after) > 0 and killed["node"] not in set(after["node_id"])


def test_readme_ray_job_submit_line(cluster, tiny_models, s3_server):
    """The README's `ray job submit` line as written, against this cluster's job server (RAY_ADDRESS, token
    auth) and the S3 test server, with one addition: `--runtime-env-json` carrying the test server's
    credentials, which a cloud cluster's nodes get from their instance role (docs/clusters.md)."""
    from tests.test_readme import job_lines, s3_env, s3_job_output, upload_inputs

    line = job_lines()[3]
    assert line.startswith("ray job submit -- snapref-ray render s3://my-bucket/manifest.csv")
    rows = upload_inputs(s3_server, tiny_models)
    credentials = json.dumps({"env_vars": {**s3_env(s3_server), "AWS_EC2_METADATA_DISABLED": "true"}})
    submit = line.replace("ray job submit --", f"ray job submit --runtime-env-json '{credentials}' --", 1)
    env = {**cluster.driver_env(), "RAY_ADDRESS": cluster.dashboard_url}
    done = subprocess.run(["bash", "-c", submit], env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "succeeded" in done.stdout + done.stderr
    summary, table = s3_job_output(s3_server, "job2")
    assert (summary["images_this_run"], summary["failed_items"]) == (len(rows), 0)
    # On a cluster, `device: auto` asked for GPU workers: they ran on the GPU nodes, never on the head.
    head = {n["NodeID"] for n in ray.nodes() if not n["Resources"].get("GPU")}
    assert set(summary["images_per_node"]) and not set(summary["images_per_node"]) & head
    assert sorted(r["prompt"] for r in table) == sorted(r["prompt"] for r in rows)
    # Without the token mode the same CLI is refused (what users of Ray 2.60 clusters meet).
    env = {k: v for k, v in cluster.driver_env().items() if k != "RAY_AUTH_MODE"}
    env["RAY_AUTH_MODE"] = "disabled"
    refused = subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", "job", "list", "--address", cluster.dashboard_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0


def test_cross_node_transfer_benchmark_smoke(cluster):
    """benchmarks/cross_node_transfer.py --smoke on two nodes of this cluster: a RefKV really moves
    between object stores, and the break-even table has a decision for every link speed."""
    from benchmarks import cross_node_transfer

    record = cross_node_transfer.main(["--smoke"])
    assert set(cross_node_transfer.FIELDS) <= set(record)
    assert record["nodes"]["holder"] != record["nodes"]["reader"]
    assert record["refkv_bytes"] > 100 * 1024  # above Ray's inline limit: fetched from the other object store
    assert (
        record["refkv_bytes"]
        == 2
        * record["encode"]["blocks_real"]
        * record["refkv_shape"][2]
        * record["refkv_shape"][3]
        * record["refkv_shape"][4]
        * 2
    )  # bf16 K and V of every block
    assert [row["gbps"] for row in record["break_even"][:3]] == [10.0, 25.0, 100.0]
    for row in record["break_even"]:
        assert set(cross_node_transfer.BREAK_EVEN_FIELDS) <= set(row)
        expected = "fetch" if row["transfer_seconds"] < row["encode_seconds"] else "re-encode"
        assert row["choice"] == expected
