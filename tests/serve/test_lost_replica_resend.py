"""A replica that dies while reading a request, behind HAProxy as Serve configures it.

HAProxy runs with the configuration Serve's own template renders (Ray's HAProxyApi, with the
retry-on list of direct_ingress_env) in front of two servers: one that answers every request, and
one that answers HAProxy's health checks and the first request on each connection, then resets the
connection once it has read the head of the next (a replica killed while HAProxy sends a request
over the connection it pooled: the case seen in CI, `SH--` with 0 retries). HAProxy can re-send such
a request to the other server only if it had all of it when it sent it:

- sent as http.client sends it (head, then body, two writes), it is often lost (the control: at
  least one is, so the set-up reproduces what it must);
- sent by SnapRefClient (one write), every one is answered, with the client's own retries off.

`pytest -s` prints the counts (RESEND lines).
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.request import Request, urlopen

import pytest

from snapref_ray.client import SnapRefClient
from snapref_ray.serve.config import ServeConfig
from snapref_ray.serve.direct_ingress import direct_ingress_env, free_port, haproxy_binary
from tests.raw_http import read_head, read_request, reset

pytestmark = pytest.mark.skipif(haproxy_binary() is None, reason="haproxy is not installed (apt-get install haproxy)")

BODY = b'{"prompt": "1girl, in a cafe", "seed": 7, "reference_id": "' + b"0" * 64 + b'"}'
HITS = 12  # requests the dying server must have read, per client


class _Server:
    """Answers /-/healthz with 200; any other request: 200 ("good"), or ("dying") 200 for the first on a
    connection and a reset after the head of the next."""

    def __init__(self, dying: bool) -> None:
        self.dying, self.read = dying, 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        with conn:
            served = 0  # requests other than health checks answered on this connection
            try:
                while True:  # HAProxy keeps server connections open between requests
                    head = read_head(conn)
                    if head is None:
                        return
                    if self.dying and not head.startswith(b"GET /-/healthz") and served >= 1:
                        self.read += 1
                        reset(conn)
                        return
                    read_request(conn, head)
                    served += 0 if head.startswith(b"GET /-/healthz") else 1
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 4\r\n\r\n\x89PNG")
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()


def _serve_haproxy_config(workdir: Path, port: int, servers: list[tuple[str, int]]) -> Path:
    """The configuration Serve's HAProxy manager writes for one app on `servers`, listening on `port`."""
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions

    env = direct_ingress_env(ServeConfig(model="m"), haproxy_binary(), workdir)
    config = HAProxyConfig(
        http_options=HTTPOptions(host="127.0.0.1", port=port),
        socket_path=str(workdir / "admin.sock"),
        server_state_base=str(workdir),
        server_state_file=str(workdir / "server-state"),
        stats_port=free_port(),
        metrics_port=free_port(),
        metrics_enabled=False,
        has_received_routes=True,
        has_received_servers=True,
        retry_on=env["RAY_SERVE_HAPROXY_RETRY_ON"],
    )
    backend = BackendConfig(
        name="snapref", path_prefix="/", servers=[ServerConfig(name, "127.0.0.1", p) for name, p in servers]
    )
    path = workdir / "haproxy.cfg"
    api = HAProxyApi(config, {"snapref": backend}, config_file_path=str(path))
    api._initialize_directories_and_error_files()
    api._generate_config_file_internal()
    return path


@pytest.fixture(scope="module")
def front(tmp_path_factory) -> Iterator[tuple[str, _Server]]:
    workdir = tmp_path_factory.mktemp("haproxy")
    dying, good = _Server(dying=True), _Server(dying=False)
    port = free_port()
    cfg = _serve_haproxy_config(workdir, port, [("dying", dying.port), ("good", good.port)])
    text = cfg.read_text()
    assert "option redispatch 1" in text and "retry-on conn-failure empty-response junk-response" in text
    haproxy = subprocess.Popen([haproxy_binary(), "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:  # up, with both servers passing their health checks
            try:
                with urlopen(f"{url}/-/healthz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert haproxy.poll() is None, haproxy.stderr.read().decode()
            assert time.monotonic() < deadline, "haproxy did not come up"
            time.sleep(0.1)
        yield url, dying
    finally:
        haproxy.terminate()
        haproxy.wait(10)
        dying.close()
        good.close()


def _until_the_dying_server_read(dying: _Server, send: Callable[[], None]) -> tuple[int, int]:
    """Send until the dying server has read HITS more requests; (requests sent, requests lost)."""
    target, sent, lost = dying.read + HITS, 0, 0
    deadline = time.monotonic() + 120
    while dying.read < target:
        # HAProxy marks the dying server down after 3 errors in a row, and up again once two health
        # checks pass (250 ms apart): meanwhile every request goes to the good one.
        assert time.monotonic() < deadline, f"the dying server read {dying.read - target + HITS} of {HITS}"
        sent += 1
        try:
            send()
        except OSError:  # urllib's HTTPError (the front's 500) and dropped connections alike
            lost += 1
    return sent, lost


def test_two_writes_are_often_lost_when_the_replica_dies_reading(front) -> None:
    url, dying = front

    def send() -> None:
        with urlopen(
            Request(f"{url}/v1/render", data=BODY, headers={"Content-Type": "application/json"}), timeout=10
        ) as r:
            assert r.read() == b"\x89PNG"

    sent, lost = _until_the_dying_server_read(dying, send)
    print(f"RESEND two writes (http.client): {lost} of {sent} requests lost, {HITS} read by the dying server")
    assert lost >= 1


def test_snaprefclient_requests_are_re_sent_by_the_front(front) -> None:
    url, dying = front
    client = SnapRefClient(url, token="", retries=0)  # HAProxy's own re-send, nothing from the client
    sent, lost = _until_the_dying_server_read(dying, lambda: client.render("1girl", width=256))
    print(
        f"RESEND one write (SnapRefClient, retries=0): {lost} of {sent} requests lost, {HITS} read by the dying server"
    )
    assert lost == 0
