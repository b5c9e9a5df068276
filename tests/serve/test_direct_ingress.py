"""The local server's front door: HAProxy on the port, forwarding straight to the ingress replicas.

A real local Serve in HAProxy mode (snapref_ray/serve/direct_ingress.py; the session's, started as
`start_local_serve` starts it: tests/conftest.py) with the tiny models and two fused replicas (ingress
replicas that render). The rest of tests/serve runs its HTTP behaviours through the same front (it
is the default); this module checks what is particular to it: who answers the port, what listens
where, renders spread over the replicas, uploads larger than Serve's gRPC default crossing
deployments, and a replica that dies and comes back behind the same public address while the
other keeps answering.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

import numpy as np
import pytest
from PIL import Image

from snapref_ray.client import SnapRefClient
from snapref_ray.serve.config import ServeConfig, ServeLimits
from snapref_ray.serve.direct_ingress import direct_ingress_env, environment, grpc_message_limit, haproxy_binary
from tests.serve.conftest import free_port

SMALL = {"width": 256, "height": 256, "steps": 2}
# Larger than Serve's replica-side gRPC default (4 MiB), which the ingress -> store call must pass.
BIG_UPLOAD_BYTES = 6 * 2**20
LIMITS = ServeLimits(max_upload_bytes=8 * 2**20)
REPLICAS = 2

needs_haproxy = pytest.mark.skipif(
    haproxy_binary() is None, reason="haproxy is not installed (apt-get install haproxy)"
)


# -- without a server ----------------------------------------------------------------------------
def test_environment_restores_what_it_changed(monkeypatch) -> None:
    monkeypatch.setenv("SNAPREF_TEST_KEEP", "before")
    monkeypatch.delenv("SNAPREF_TEST_NEW", raising=False)
    with environment({"SNAPREF_TEST_KEEP": "during", "SNAPREF_TEST_NEW": "x"}):
        assert os.environ["SNAPREF_TEST_KEEP"] == "during" and os.environ["SNAPREF_TEST_NEW"] == "x"
    assert os.environ["SNAPREF_TEST_KEEP"] == "before" and "SNAPREF_TEST_NEW" not in os.environ


def test_grpc_limit_carries_the_largest_upload_and_reply() -> None:
    config = ServeConfig(
        model="m",
        limits=ServeLimits(max_upload_bytes=100 * 2**20, max_megapixels=4.0, max_n=4),
        max_batch=4,
        reference_store_bytes=2**30,
    )
    limit = grpc_message_limit(config)
    assert limit >= 2 * config.limits.max_upload_bytes  # a pair of uploads read back by a renderer
    assert limit >= 4 * 4.0e6 * 3  # four stored 4 MP RGB PNGs in one reply
    assert grpc_message_limit(ServeConfig(model="m")) > 4 * 2**20  # above Serve's own default


def test_each_server_gets_its_own_haproxy_files_and_ports(tmp_path: Path) -> None:
    config = ServeConfig(model="m", port=free_port())
    a = direct_ingress_env(config, "/usr/sbin/haproxy", tmp_path / "a")
    b = direct_ingress_env(config, "/usr/sbin/haproxy", tmp_path / "b")
    assert a["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and a["RAY_SERVE_HAPROXY_BINARY_PATH"] == "/usr/sbin/haproxy"
    for name in (
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC",
        "RAY_SERVE_HAPROXY_SOCKET_PATH",
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE",
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH",
    ):
        assert a[name].startswith(str(tmp_path / "a")) and b[name].startswith(str(tmp_path / "b"))
    # Serve's defaults (8404, 9101) would make a second server on the machine fail to start its HAProxy.
    ports = {
        a[f"RAY_SERVE_{name}_PORT"]
        for name in ("HAPROXY_STATS", "HAPROXY_METRICS", "FALLBACK_PROXY_HTTP", "FALLBACK_PROXY_GRPC")
    }
    assert len(ports) == 4 and ports.isdisjoint({"8404", "9101", "8500", "9500"})


def test_without_haproxy_the_server_keeps_serves_proxy_and_says_so(monkeypatch, caplog) -> None:
    from snapref_ray.pipelines import serve_app

    monkeypatch.setattr(serve_app, "_haproxy_dir", None)  # the session's server (if running) keeps its own
    monkeypatch.setattr(serve_app, "haproxy_binary", lambda: None)
    with caplog.at_level("WARNING", logger=serve_app.__name__):
        assert serve_app._direct_ingress_env(ServeConfig(model="m")) == {}
    assert "haproxy is not installed" in caplog.text and serve_app.http_front() == "serve_proxy"


def test_the_operators_own_serve_settings_win(monkeypatch) -> None:
    from snapref_ray.pipelines import serve_app

    monkeypatch.setattr(serve_app, "_haproxy_dir", None)  # the session's server (if running) keeps its own
    monkeypatch.setattr(serve_app, "haproxy_binary", lambda: "/opt/haproxy/bin/haproxy")
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "30")
    try:
        env = serve_app._direct_ingress_env(ServeConfig(model="m"))
        assert "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S" not in env  # left as the operator set it
        assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == "/opt/haproxy/bin/haproxy"
        # HAProxy refuses unix socket paths over 97 bytes; Serve puts a 56-character node id folder
        # between this folder and the socket name.
        longest = max(
            len(env[name]) for name in ("RAY_SERVE_HAPROXY_SOCKET_PATH", "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH")
        )
        assert longest + 57 <= 97
    finally:
        serve_app._haproxy_dir.cleanup()
        serve_app._haproxy_dir = None


# -- a running server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(local_serve, tiny_models: Path):
    if haproxy_binary() is None:
        pytest.skip("haproxy is not installed (apt-get install haproxy)")
    config = ServeConfig(
        model=str(tiny_models),
        port=local_serve.port,
        limits=LIMITS,
        topology="fused",
        min_replicas=REPLICAS,
        max_replicas=REPLICAS,
        reference_store_bytes=64 * 2**20,
    )
    with local_serve.deployed(config) as url:
        yield url, config, local_serve.haproxy_dir


def _haproxy_cfg(workdir: Path) -> str:
    (path,) = workdir.glob("*/haproxy.cfg")  # Serve writes it under a folder named by the node id
    return path.read_text()


def _ingress_servers(workdir: Path) -> list[tuple[str, int]]:
    """(host, port) of the ingress replicas HAProxy forwards the app's requests to."""
    # Beside them HAProxy keeps Serve's proxy as a backup server (for while no replica is up).
    servers = re.findall(r"^\s*server\s+SERVE_REPLICA\S+\s+([\d.]+):(\d+)", _haproxy_cfg(workdir), flags=re.M)
    return [(host, int(port)) for host, port in servers]


def _listed_replicas(workdir: Path, timeout_s: float = 60.0) -> list[tuple[str, int]]:
    """The ingress replicas in HAProxy's configuration once it lists all REPLICAS of them. Serve gathers
    replica changes for a moment before it rewrites the file, so a replica that just became ready (and
    let deploy_local return) may be missing for a second or two; meanwhile HAProxy uses the others."""
    deadline = time.monotonic() + timeout_s
    while len(set(servers := _ingress_servers(workdir))) < REPLICAS:
        assert time.monotonic() < deadline, _haproxy_cfg(workdir)
        time.sleep(0.2)
    return servers


def _health(base: str) -> int:
    with urlopen(f"{base}/v1/health", timeout=10) as r:
        return r.status


@needs_haproxy
def test_haproxy_answers_the_port_and_forwards_to_each_replica_itself(server) -> None:
    from snapref_ray.pipelines.serve_app import http_front

    url, config, workdir = server
    assert http_front() == "haproxy"
    cfg = _haproxy_cfg(workdir)
    assert re.search(rf"^\s*bind\s+127\.0\.0\.1:{config.port}\s*$", cfg, flags=re.M), cfg
    servers = _listed_replicas(workdir)
    for host, port in servers:
        assert port != config.port
        # Each replica is an HTTP server of its own: no proxy actor between HAProxy and the app.
        assert _health(f"http://{host}:{port}") == 200
    assert _health(url) == 200


@needs_haproxy
def test_haproxy_spreads_renders_over_the_fused_replicas(server, tiny_models: Path) -> None:
    url, _, _ = server
    client = SnapRefClient(url, timeout=300, retries=0)
    reference_id = client.upload_reference((tiny_models / "reference.png").read_bytes())

    def render(seed: int) -> str:
        body = json.dumps(
            {"prompt": "a girl", "seed": seed, "reference_id": reference_id, "width": 256, "height": 256, "steps": 4}
        ).encode()
        request = Request(f"{url}/v1/render", data=body, headers={"Content-Type": "application/json"})
        with urlopen(request, timeout=300) as r:
            assert r.headers["Content-Type"] == "image/png" and r.read()[:4] == b"\x89PNG"
            return r.headers["X-Replica"]

    with ThreadPoolExecutor(4) as pool:  # concurrent: HAProxy's leastconn gives the second to the idle replica
        replicas = list(pool.map(render, range(8)))
    assert len(set(replicas)) == REPLICAS, replicas


def _other_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


@needs_haproxy
def test_the_api_listens_on_loopback_only(server) -> None:
    url, config, workdir = server
    servers = _listed_replicas(workdir)
    assert all(host == "127.0.0.1" for host, _ in servers), servers
    other = _other_address()
    if other is None:
        pytest.skip("this machine has no non-loopback address to try")
    for port in (config.port, *(port for _, port in servers)):
        with socket.socket() as s, pytest.raises(OSError):
            s.settimeout(5)
            s.connect((other, port))


def _noise_png(nbytes: int) -> bytes:
    """A PNG of random pixels (incompressible) of at least `nbytes` bytes."""
    side = int((nbytes / 3) ** 0.5) + 8
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=0)
    assert nbytes <= len(buf.getvalue()) <= LIMITS.max_upload_bytes
    return buf.getvalue()


@needs_haproxy
def test_an_upload_larger_than_grpcs_default_crosses_the_deployments(server) -> None:
    url, config, _ = server
    client = SnapRefClient(url, timeout=300, retries=0)
    data = _noise_png(BIG_UPLOAD_BYTES)
    reference_id = client.upload_reference(data)  # ingress -> ReferenceStore over gRPC
    png = client.render("a girl in a garden", reference_id=reference_id, **SMALL)  # store -> renderer
    assert Image.open(io.BytesIO(png)).size == (256, 256)


def _ingress_actor_names() -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "SnapRefIngress" in a["name"]]


def _port_of_replica(workdir: Path, actor_name: str) -> int:
    """The port HAProxy forwards to for the ingress replica whose actor is `actor_name`
    ("SERVE_REPLICA::<app>#<deployment>#<id>"; HAProxy names it SERVE_REPLICA_<app>-<deployment>-<id>)."""
    replica_id = actor_name.rsplit("#", 1)[-1]
    match = re.search(
        rf"^\s*server\s+SERVE_REPLICA\S*-{re.escape(replica_id)}\s+[\d.]+:(\d+)", _haproxy_cfg(workdir), flags=re.M
    )
    assert match, (actor_name, _haproxy_cfg(workdir))
    return int(match.group(1))


def _wait_until_refused(host: str, port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
        except ConnectionRefusedError:
            return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{host}:{port} still accepts connections"
        time.sleep(0.05)


@needs_haproxy
def test_a_killed_replica_comes_back_behind_the_same_address(server, tiny_models: Path) -> None:
    import ray

    url, config, workdir = server
    names = _ingress_actor_names()
    assert len(names) == REPLICAS, names
    _listed_replicas(workdir)  # HAProxy knows the survivor (with only the dead one listed, it has no other)
    victim_port = _port_of_replica(workdir, names[0])
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    # ray.kill returns before the process is gone; a request HAProxy forwards to a replica that dies
    # while reading it is not retried (see README, Serving), so first wait until it is dead: its port
    # refuses connections, as after a crash.
    _wait_until_refused("127.0.0.1", victim_port)
    client = SnapRefClient(url, timeout=300, retries=0)
    reference_id = client.upload_reference((tiny_models / "reference.png").read_bytes())
    # The other replica answers meanwhile (HAProxy re-dispatches a refused connection).
    assert client.render("during the restart", reference_id=reference_id, **SMALL)[:4] == b"\x89PNG"
    deadline = time.monotonic() + 120
    while True:  # back when HAProxy forwards to a new replica beside the survivor
        try:
            live = _ingress_actor_names()
            if (
                names[0] not in live
                and len(live) == REPLICAS
                and len(set(_ingress_servers(workdir))) == REPLICAS
                and all(_health(f"http://{h}:{p}") == 200 for h, p in _ingress_servers(workdir))
            ):
                break
        except (HTTPError, URLError, ConnectionError, TimeoutError):
            pass
        assert time.monotonic() < deadline, "the replica did not come back within 120 s"
        time.sleep(0.5)
    assert client.render("after the restart", reference_id=reference_id, **SMALL)[:8] == b"\x89PNG\r\n\x1a\n"
