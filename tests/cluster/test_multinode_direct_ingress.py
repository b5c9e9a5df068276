"""Serve's HAProxy mode on a real multi-node cluster (the session's fake cluster, tests/conftest.py,
at most 2 GPU nodes for this module) as README.md, Serving, has cluster operators run it: the
direct-ingress environment (`direct_ingress_env`) in every Serve process, HAProxy on the head, and
two fused replicas (ingress + renderer) on two autoscaled GPU nodes. Real HTTP on 127.0.0.1. The
environment is the runtime environment of the module's job, which Serve's controller, its HAProxy
manager and the replicas run under (the cluster is shared with modules that run Serve's own proxy);
README.md sets it on the Ray processes themselves, which comes to the same for Serve.

- HAProxy on the head forwards to both replicas, each on its own GPU node, and renders spread
  over them.
- A GPU node dies (its raylet SIGKILLed, its processes with it): the next requests succeed through
  the surviving replica, with no retry by the client.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from ray import serve

from benchmarks.fake_cluster import FakeCluster
from snapref_ray.client import SnapRefClient
from snapref_ray.serve.config import ServeConfig
from snapref_ray.serve.direct_ingress import direct_ingress_env, haproxy_binary
from tests.serve.conftest import free_port

# Its last test kills a GPU node: after the other fake-cluster modules, none of which then starts cold.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.ray_order(1)]

TOKEN = "direct-ingress-token-3b9f"
SMALL = {"width": 256, "height": 256, "steps": 2, "response_format": "json"}
REPLICAS = 2


@pytest.fixture(scope="module")
def haproxy_dir() -> Iterator[Path]:
    if haproxy_binary() is None:
        pytest.skip("haproxy is not installed (apt-get install haproxy)")
    # Short and under /tmp: HAProxy caps its socket paths at 97 bytes (see direct_ingress.py).
    with tempfile.TemporaryDirectory(prefix="srhap-", dir="/tmp") as folder:
        yield Path(folder)


@pytest.fixture(scope="module")
def server(
    haproxy_dir: Path, shared_fake_cluster, tiny_models: Path, tmp_path_factory
) -> Iterator[tuple[FakeCluster, str]]:
    from snapref_ray.pipelines.serve_app import APP_NAME, build_app

    # Durable references (a folder every fake node sees): the store may live on the node that dies.
    config = ServeConfig(
        model=str(tiny_models),
        host="127.0.0.1",
        port=free_port(),
        token=TOKEN,
        topology="fused",
        min_replicas=REPLICAS,
        max_replicas=REPLICAS,
        gpus_per_replica=1,
        cpus_per_replica=1,
        request_timeout_s=120,
        references_uri=str(tmp_path_factory.mktemp("durable-references")),
    )
    env = direct_ingress_env(config, haproxy_binary(), haproxy_dir)
    # The head's 2 CPUs: the reference store and Serve's own actors fit on the head; each GPU node's one
    # CPU goes to its replica.
    with shared_fake_cluster(max_gpu_nodes=REPLICAS, env=env) as cluster:
        # One HAProxy, on the head: every fake node shares this machine's ports.
        serve.start(
            proxy_location="HeadOnly",
            http_options={"host": config.host, "port": config.port, "request_timeout_s": config.proxy_timeout_s()},
            controller_options={"runtime_env": {"env_vars": env}},
        )
        try:
            serve.run(build_app(config), name=APP_NAME, route_prefix="/")
            yield cluster, f"http://127.0.0.1:{config.port}"
        finally:
            serve.shutdown()


@pytest.fixture(scope="module")
def client(server) -> SnapRefClient:
    return SnapRefClient(server[1], token=TOKEN, timeout=120, retries=0)


def _haproxy_servers(haproxy_dir: Path, count: int, timeout_s: float = 60.0) -> list[str]:
    """The replica addresses in HAProxy's configuration, once it lists `count` of them (Serve gathers
    replica changes for a moment before it rewrites the file)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = "\n".join(p.read_text() for p in haproxy_dir.glob("*/haproxy.cfg"))
        servers = sorted(set(re.findall(r"^\s*server\s+SERVE_REPLICA\S+\s+(\S+:\d+)", text, flags=re.M)))
        if len(servers) >= count:
            return servers
        assert time.monotonic() < deadline, text
        time.sleep(0.2)


def _spread(client: SnapRefClient, reference_id: str, rounds: int = 3) -> list[str]:
    """Replicas that answered batches of concurrent renders (HAProxy's leastconn spreads them)."""

    def render(seed: int) -> str:
        return client.render("1girl, portrait", reference_id=reference_id, seed=seed, **SMALL)["replica"]

    answered: list[str] = []
    with ThreadPoolExecutor(4) as pool:
        for round_ in range(rounds):
            answered += pool.map(render, range(8 * round_, 8 * round_ + 8))
            if len(set(answered)) >= REPLICAS:
                break
    return answered


def test_haproxy_on_the_head_spreads_renders_over_replicas_on_two_gpu_nodes(
    server, haproxy_dir, client, tiny_models: Path
) -> None:
    cluster, _ = server
    # Two replicas of one GPU each and two one-GPU nodes (the head has none): one replica per node.
    assert len(cluster.gpu_node_ids()) == REPLICAS
    assert len(_haproxy_servers(haproxy_dir, REPLICAS)) == REPLICAS
    reference_id = client.upload_reference((tiny_models / "reference.png").read_bytes())
    answered = _spread(client, reference_id)
    assert len(set(answered)) == REPLICAS, answered


def test_a_lost_gpu_node_leaves_the_survivor_answering(server, haproxy_dir, client, tiny_models: Path) -> None:
    cluster, _ = server
    reference_id = client.upload_reference((tiny_models / "reference.png").read_bytes())
    before = set(_spread(client, reference_id))  # both replicas hold the reference now
    assert len(before) == REPLICAS, before
    victim = cluster.gpu_node_ids()[0]
    cluster.kill_node(victim)
    # HAProxy still lists the dead replica until Serve notices; a request it sends there finds a
    # refused or silent connection and is re-dispatched to the other replica.
    answers = [
        client.render("1girl, after the node loss", reference_id=reference_id, seed=i, **SMALL) for i in range(6)
    ]
    assert all(a["images"] for a in answers)
    # One replica answered them all: sequential requests to two live replicas would alternate (leastconn
    # with both idle), so the other one is the victim's.
    survivors = {a["replica"] for a in answers}
    assert len(survivors) == 1 and survivors <= before, (survivors, before)
