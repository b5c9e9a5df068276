"""The endpoint under hostile clients, over real HTTP to a real local Serve on 127.0.0.1.

Every case sends the hostile request on a raw socket (so nothing on the client side tidies it up),
checks the answer (status, JSON error shape, the field named) and that the server still serves a
health check and a normal request afterwards or meanwhile. Counts and times are bounded: the
floods are a few dozen connections for a few seconds. Latencies are printed as `HOSTILE ...`
lines (run with -s to see them); no test asserts on wall-clock time.
"""

from __future__ import annotations

import base64
import json
import select
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from snapref_ray.serve.config import ServeConfig, ServeLimits
from tests.ray_session import LogMark

TOKEN = "hostile-test-token"
AUTH = f"Bearer {TOKEN}"
SMALL = {"width": 256, "height": 256, "steps": 1}
LIMITS = ServeLimits(
    max_upload_bytes=300_000,
    max_steps=8,
    max_n=2,
    max_side=512,
    max_prompt_chars=200,
    max_form_parts=8,
    max_part_header_bytes=1024,
)
# Small enough that the flood below (30 slow clients) would fill the ingress without admission.
CONFIG = {
    "token": TOKEN,
    "limits": LIMITS,
    "min_replicas": 1,
    "max_replicas": 1,
    "max_batch": 2,
    "request_timeout_s": 120,
    "retry_after_s": 2,
    "body_timeout_s": 5.0,
    "body_min_rate_bytes_s": 1000.0,
    "body_grace_s": 1.0,
    "fast_body_s": 0.3,
    "max_slow_bodies": 3,
    "ingress_max_ongoing_requests": 10,
    # A short proxy queue: were the ingress full, health would get Serve's 503 at once, not wait.
    # (Not shorter: the router also counts requests waiting for their replica assignment, so a
    # burst of a few requests to an idle ingress can briefly queue.)
    "ingress_max_queued_requests": 8,
}
SOCKET_TIMEOUT = 60


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float

    def error(self) -> dict:
        assert self.headers.get("content-type", "").startswith("application/json"), (self.status, self.headers)
        error = json.loads(self.body)["error"]
        assert set(error) == {"field", "message"}, error
        return error


@pytest.fixture(scope="module")
def server(local_serve, tiny_models: Path):
    global _SERVER_LOGS
    config = ServeConfig(model=str(tiny_models), port=local_serve.port, **CONFIG)
    # The session's Ray logs hold earlier modules' servers too: this module reads what its own wrote.
    _SERVER_LOGS = LogMark(local_serve.logs_dir)
    with local_serve.deployed(config):
        yield config.port


@pytest.fixture(scope="module")
def reference_png(tiny_models: Path) -> bytes:
    return (tiny_models / "reference.png").read_bytes()


@pytest.fixture(scope="module")
def reference_id(server: int, reference_png: bytes) -> str:
    answer = _upload(server, reference_png)
    assert answer.status == 200, answer
    return json.loads(answer.body)["reference_id"]


# -- raw HTTP ----------------------------------------------------------------------------------
def _request(
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    host: str = "127.0.0.1",
    content_length: int | None = None,
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method in ("POST", "PUT") or content_length is not None:
        lines.append(f"Content-Length: {len(body) if content_length is None else content_length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _read_answer(sock: socket.socket, started: float, head: bool = False) -> Answer:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before the headers: {data[:200]!r}")
        data += chunk
    header_block, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = header_block.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    length = 0 if head else int(headers.get("content-length", "-1"))
    while length < 0 or len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return Answer(
        int(status_line.split()[1]), headers, body[:length] if length >= 0 else body, time.perf_counter() - started
    )


def _send(port: int, raw: bytes, head: bool = False) -> Answer:
    with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT) as sock:
        started = time.perf_counter()
        try:
            sock.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):  # answered before the body was sent: read the answer
            pass
        return _read_answer(sock, started, head)


def _get(port: int, path: str, token: bool = True, method: str = "GET", **kw) -> Answer:
    headers = {"Authorization": AUTH} if token else {}
    return _send(port, _request(method, path, headers=headers, **kw), head=method == "HEAD")


def _post_json(port: int, path: str, body, content_type: str = "application/json") -> Answer:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return _send(port, _request("POST", path, raw, {"Authorization": AUTH, "Content-Type": content_type}))


def _multipart(parts: list[tuple[bytes, bytes]], boundary: bytes = b"hostileboundary") -> tuple[bytes, str]:
    """(body, content type) of raw parts: each (header block, content)."""
    body = b"".join(b"--" + boundary + b"\r\n" + head + b"\r\n\r\n" + content + b"\r\n" for head, content in parts)
    return body + b"--" + boundary + b"--\r\n", f"multipart/form-data; boundary={boundary.decode()}"


def _disposition(name: str, filename: str | None = None) -> bytes:
    return (
        f'Content-Disposition: form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    ).encode()


def _upload_raw(port: int, body: bytes, content_type: str) -> Answer:
    return _send(port, _request("POST", "/v1/references", body, {"Authorization": AUTH, "Content-Type": content_type}))


def _upload(port: int, png: bytes, **fields: str) -> Answer:
    parts = [(_disposition(k), v.encode()) for k, v in fields.items()] + [(_disposition("file", "a.png"), png)]
    return _upload_raw(port, *_multipart(parts))


def _assert_serving(port: int, reference_id: str | None = None) -> None:
    """Health answers, and a normal request with a body is served."""
    assert _get(port, "/v1/health", token=False).status == 200
    if reference_id:
        answer = _post_json(port, "/v1/render", {"prompt": "still serving", "reference_id": reference_id, **SMALL})
        assert answer.status == 200 and answer.headers["content-type"] == "image/png", answer


def _report(case: str, **figures) -> None:
    print(f"HOSTILE {case}: " + json.dumps(figures), flush=True)


class HealthProbe:
    """Polls /v1/health every `interval` s in a thread while a flood runs; statuses and latencies."""

    def __init__(self, port: int, interval: float = 0.1) -> None:
        self.port, self.interval = port, interval
        self.results: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                answer = _get(self.port, "/v1/health", token=False)
                self.results.append((answer.status, answer.seconds))
            except OSError:  # a refused or reset connection is a failed probe, not a test crash
                self.results.append((-1, float("nan")))
            self._stop.wait(self.interval)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=SOCKET_TIMEOUT)

    def figures(self) -> dict:
        latencies = sorted(s for _, s in self.results)
        return {
            "probes": len(self.results),
            "non_200": sum(1 for code, _ in self.results if code != 200),
            "p50_ms": round(statistics.median(latencies) * 1e3, 1),
            "max_ms": round(latencies[-1] * 1e3, 1),
        }


# -- 1. slow bodies ----------------------------------------------------------------------------
def _slow_client(
    port: int,
    path: str,
    content_type: str,
    prefix: bytes,
    declared: int,
    chunk: int,
    interval: float,
    give_up_s: float = 30.0,
) -> Answer | None:
    """Valid headers with the token, then `chunk` bytes every `interval` s; the answer (None: no answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT) as sock:
        started = time.perf_counter()
        sock.sendall(
            _request(
                "POST", path, prefix, {"Authorization": AUTH, "Content-Type": content_type}, content_length=declared
            )
        )
        sent = len(prefix)
        while time.perf_counter() - started < give_up_s:
            readable, _, _ = select.select([sock], [], [], interval)
            if readable:
                return _read_answer(sock, started)
            if sent < declared:
                try:
                    sock.sendall(b"x" * min(chunk, declared - sent))
                    sent += chunk
                except OSError:
                    return _read_answer(sock, started)
    return None


@pytest.mark.slow
def test_slow_body_flood_leaves_health_and_normal_clients_served(
    server: int, reference_id: str, reference_png: bytes
) -> None:
    form_prefix = b"--b\r\n" + _disposition("file", "a.png") + b"\r\n\r\n"
    kinds = [  # (path, content type, prefix, bytes per send, seconds between sends)
        ("/v1/render", "application/json", b'{"prompt": "', 1, 0.5),  # a byte every 0.5 s: below the minimum rate
        ("/v1/references", "multipart/form-data; boundary=b", form_prefix, 2000, 0.4),  # 5 kB/s: slow, above it
    ]
    flood = 30

    def one(i: int) -> Answer | None:
        time.sleep(0.1 * i)  # 10 new slow connections a second
        path, content_type, prefix, chunk, interval = kinds[i % 2]
        return _slow_client(server, path, content_type, prefix, 100_000, chunk, interval)

    with HealthProbe(server) as probe, ThreadPoolExecutor(flood) as pool:
        answers = pool.map(one, range(flood))
        time.sleep(1.0)
        normal_upload = _upload(server, reference_png, ref_caption="during the flood")
        normal_render = _post_json(server, "/v1/render", {"prompt": "during", "reference_id": reference_id, **SMALL})
        answers = list(answers)
    assert all(a is not None for a in answers), "a slow client got no answer"
    statuses = [a.status for a in answers]
    assert set(statuses) <= {408, 503}, statuses
    for a in answers:
        error = a.error()
        assert error["field"] in ("body", "file")
        if a.status == 503:
            assert a.headers["retry-after"] == "2" and "slow uploads are already in progress" in error["message"]
        else:
            assert "slower than 1000 bytes/s" in error["message"] or "body_timeout_s=5" in error["message"]
    assert 408 in statuses and 503 in statuses, statuses  # some waited their turn, the rest were turned away
    assert normal_upload.status == 200 and normal_render.status == 200, (normal_upload, normal_render)
    health = probe.figures()
    assert health["probes"] >= 5 and health["non_200"] == 0, probe.results
    _report(
        "slow-body flood",
        clients=flood,
        answers={s: statuses.count(s) for s in sorted(set(statuses))},
        answer_s={
            s: round(statistics.median(a.seconds for a in answers if a.status == s), 2) for s in sorted(set(statuses))
        },
        normal_upload_ms=round(normal_upload.seconds * 1e3, 1),
        normal_render_ms=round(normal_render.seconds * 1e3, 1),
        health=health,
    )
    _assert_serving(server, reference_id)


# -- 2. multipart ------------------------------------------------------------------------------
@pytest.mark.slow
def test_many_part_flood_is_refused_at_the_first_extra_part(server: int, reference_id: str) -> None:
    tiny_parts = [(_disposition(f"f{i}"), b"v") for i in range(4000)]  # ~200 kB of 4000 parts
    body, content_type = _multipart(tiny_parts)
    assert len(body) < LIMITS.max_upload_bytes

    def one(_: int) -> Answer:
        return _upload_raw(server, body, content_type)

    with HealthProbe(server, interval=0.05) as probe, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, range(16)))
        during = _post_json(server, "/v1/render", {"prompt": "during", "reference_id": reference_id, **SMALL})
    for a in answers:
        assert a.status == 400, a
        error = a.error()
        # The first offending part and how far the parser got, not a list of every part.
        assert (error["field"], error["message"]) == (
            "f0",
            "part 1 is named 'f0'; an upload takes only file, ref_caption, ref_megapixels",
        )
        assert len(a.body) < 300
    assert during.status == 200
    assert probe.figures()["non_200"] == 0
    _report(
        "multipart 4000 unknown parts x16 (4 at a time)",
        status=400,
        answer_ms_p50=round(statistics.median(a.seconds for a in answers) * 1e3, 1),
        body_bytes=len(answers[0].body),
        health=probe.figures(),
    )

    # Parts with accepted names but too many of them: refused at part max_form_parts + 1.
    many, content_type = _multipart([(_disposition("ref_caption"), b"a")] + [(b"X-Pad: 1", b"v")] * 3000)
    answer = _upload_raw(server, many, content_type)
    assert answer.status == 400
    assert answer.error()["message"].startswith("part 2 has no 'Content-Disposition: form-data; name=...' header")
    counted, content_type = _multipart([(_disposition(n), b"1") for n in ("file", "ref_caption", "ref_megapixels")] * 2)
    answer = _upload_raw(server, counted, content_type)
    assert answer.status == 400 and answer.error() == {
        "field": "file",
        "message": "part 4 repeats 'file' (first sent as part 1)",
    }
    _assert_serving(server, reference_id)


def test_part_count_limit_stops_the_parser_at_the_first_extra_part() -> None:
    """With every name accepted, the count is what stops a long body: at part max_parts + 1,
    before its headers are read (the live server's names check usually fires first)."""
    import asyncio

    from snapref_ray.serve.api import ApiError
    from snapref_ray.serve.forms import MultipartForm

    body, content_type = _multipart([(_disposition(f"p{i}"), b"x") for i in range(1000)])
    form = MultipartForm(content_type, {f"p{i}": 10 for i in range(1000)}, max_parts=8, max_header_bytes=1024)

    async def one_chunk():
        yield body

    with pytest.raises(ApiError) as info:
        asyncio.run(form.feed(one_chunk()))
    assert (info.value.status, info.value.field) == (400, "body")
    assert info.value.message == "part 9 is more than the 8 parts accepted in one upload"
    assert form.count == 9 and len(form.parts) == 8


@pytest.mark.slow
def test_part_header_size_limit(server: int, reference_png: bytes) -> None:
    big_header = [(_disposition("file", "a.png") + b"\r\nX-Pad: " + b"a" * 2000, reference_png)]
    answer = _upload_raw(server, *_multipart(big_header))
    assert answer.status == 400
    assert answer.error() == {"field": "body", "message": "part 1 has more than 1024 bytes of headers"}
    _report("multipart 2 kB part header", status=400, ms=round(answer.seconds * 1e3, 1))
    no_name = b"".join(b"--b\r\n" + b"X-Empty: 1\r\n\r\n" + b"\r\n" for _ in range(20)) + b"--b--\r\n"
    answer = _upload_raw(server, no_name, "multipart/form-data; boundary=b")
    assert answer.status == 400
    assert answer.error() == {
        "field": "body",
        "message": "part 1 has no 'Content-Disposition: form-data; name=...' header",
    }
    truncated, content_type = _multipart([(_disposition("file", "a.png"), reference_png)])
    answer = _upload_raw(server, truncated[:-20], content_type)
    assert answer.status == 400 and "ends before the closing boundary" in answer.error()["message"]
    _assert_serving(server)


# -- 3. exact validation -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "raw, field, message",
    [
        (b'{"prompt": "p", "width": true}', "width", "Input should be a valid integer"),
        (b'{"prompt": "p", "steps": 2.0}', "steps", "Input should be a valid integer"),
        (b'{"prompt": "p", "cfg": "4"}', "cfg", "Input should be a valid number"),
        (b'{"prompt": "p", "ref_in_uncond": 1}', "ref_in_uncond", "Input should be a valid boolean"),
        (b'{"prompt": "p", "cfg": NaN}', "cfg", "NaN is not a number this API accepts"),
        (b'{"prompt": "p", "ref_weight": Infinity}', "ref_weight", "Infinity is not a number this API accepts"),
        (b'{"prompt": "p", "ref_weight": -Infinity}', "ref_weight", "-Infinity is not a number this API accepts"),
        (b'{"prompt": "p", "cfg": 1e999}', "cfg", "Infinity is not a number this API accepts"),
        (b'{"prompt": "p", "' + b"k" * 500 + b'": 1}', "k" * 64, "unknown field"),
        (b'["prompt"]', "body", "expected a JSON object, got list"),
        (b'{"prompt": "\xff"}', "body", "the body is not UTF-8 JSON"),
    ],
)
def test_render_fields_are_exactly_typed(server: int, raw: bytes, field: str, message: str) -> None:
    answer = _post_json(server, "/v1/render", raw)
    assert answer.status == 400, answer
    error = answer.error()
    assert error["field"] == field and message in error["message"], error
    assert len(answer.body) < 400
    _report(f"render {raw[:40]!r}", status=answer.status, field=error["field"][:20], ms=round(answer.seconds * 1e3, 1))


@pytest.mark.slow
def test_upload_fields_are_exactly_typed(server: int, reference_png: bytes, reference_id: str) -> None:
    for fields, field, message in [
        ({"ref_megapixels": "nan"}, "ref_megapixels", "NaN is not a number"),
        ({"ref_megapixels": "inf"}, "ref_megapixels", "Infinity is not a number"),
        ({"ref_megapixels": "true"}, "ref_megapixels", "not a number: 'true'"),
    ]:
        answer = _upload(server, reference_png, **fields)
        assert answer.status == 400 and answer.error()["field"] == field and message in answer.error()["message"]
        _report(f"multipart {fields}", status=answer.status, field=field, ms=round(answer.seconds * 1e3, 1))
    parts = [
        (_disposition("ref_caption"), "blue \xe9".encode("latin-1")),
        (_disposition("file", "a.png"), reference_png),
    ]
    answer = _upload_raw(server, *_multipart(parts))
    assert answer.status == 400
    assert answer.error() == {"field": "ref_caption", "message": "part 1 ('ref_caption') is not UTF-8 text (byte 5)"}
    _report("multipart latin-1 caption", status=answer.status, field="ref_caption", ms=round(answer.seconds * 1e3, 1))
    image = base64.b64encode(reference_png).decode()
    answer = _post_json(server, "/v1/references", {"image": image, "ref_megapixels": True})
    assert answer.status == 400 and answer.error()["field"] == "ref_megapixels"
    answer = _post_json(server, "/v1/references", b'{"image": "' + image.encode() + b'", "ref_megapixels": NaN}')
    assert answer.status == 400 and "NaN" in answer.error()["message"]
    _assert_serving(server, reference_id)


@pytest.mark.slow
def test_bad_ref_megapixels_on_render_names_ref_megapixels(server: int, reference_id: str) -> None:
    # Valid for the request model (> 0) but too small for the reference: found in the renderer replica.
    answer = _post_json(
        server, "/v1/render", {"prompt": "p", "reference_id": reference_id, "ref_megapixels": 0.0001, **SMALL}
    )
    assert answer.status == 400
    error = answer.error()
    assert error["field"] == "ref_megapixels" and "fitted to 0.0001 MP" in error["message"], error
    _report(
        "render ref_megapixels=0.0001 (found in the renderer replica)",
        status=answer.status,
        field=error["field"],
        ms=round(answer.seconds * 1e3, 1),
    )
    answer = _post_json(
        server, "/v1/render", {"prompt": "p", "reference_id": reference_id, "ref_megapixels": 99, **SMALL}
    )
    assert answer.status == 400 and answer.error()["field"] == "ref_megapixels"
    _assert_serving(server, reference_id)


@pytest.mark.slow
def test_render_requires_json_and_unknown_ids_are_echoed_short(server: int, reference_id: str) -> None:
    body = json.dumps({"prompt": "p", **SMALL}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "application/jsonx", ""):
        answer = _post_json(server, "/v1/render", body, content_type=content_type)
        assert answer.status == 415, (content_type, answer)
        assert answer.error()["field"] == "Content-Type"
        _report(f"render Content-Type {content_type!r}", status=415, ms=round(answer.seconds * 1e3, 1))
    answer = _post_json(server, "/v1/references", b"raw", content_type="image/png")
    assert answer.status == 415 and answer.error()["field"] == "Content-Type"
    long_id = "a" * 10_000
    answer = _post_json(server, "/v1/render", {"prompt": "p", "reference_id": long_id, **SMALL})
    assert answer.status == 404
    message = answer.error()["message"]
    assert f"'{'a' * 64}'..." in message and "a" * 65 not in message and len(answer.body) < 300
    _report(
        "render reference_id of 10,000 characters",
        status=404,
        body_bytes=len(answer.body),
        ms=round(answer.seconds * 1e3, 1),
    )
    _assert_serving(server, reference_id)


# -- 4. routing: no redirects, JSON everywhere, HEAD ---------------------------------------------
@pytest.mark.slow
def test_no_host_header_redirects_and_json_for_unknown_paths(server: int) -> None:
    for path in ("/v1/health/", "/v1/render/", "/docs/", "/v2/anything", "//evil.example/x"):
        answer = _get(server, path, host="evil.example")
        assert answer.status == 404, (path, answer)
        assert "location" not in answer.headers
        assert answer.error() == {"field": None, "message": "Not Found"}
        _report(f"GET {path} Host: evil.example", status=404, ms=round(answer.seconds * 1e3, 1))
    answer = _get(server, "/v1/render")  # a POST route asked with GET
    assert answer.status == 405 and answer.error()["message"] == "Method Not Allowed"
    _assert_serving(server)


@pytest.mark.slow
def test_head_works_where_get_does(server: int) -> None:
    for path, token in [("/v1/health", False), ("/v1/models", True), ("/openapi.json", True), ("/docs", True)]:
        get = _get(server, path, token=token)
        head = _get(server, path, token=token, method="HEAD")
        assert (get.status, head.status) == (200, 200), (path, get.status, head.status)
        assert head.body == b"" and head.headers["content-type"] == get.headers["content-type"]
        _report(f"HEAD {path}", status=head.status, ms=round(head.seconds * 1e3, 1))
    head = _get(server, "/v1/models", token=False, method="HEAD")
    assert head.status == 401 and head.body == b""
    _assert_serving(server)


# -- 5. OpenAPI and docs need the token ----------------------------------------------------------
@pytest.mark.slow
def test_openapi_declares_bearer_and_docs_need_the_token(server: int) -> None:
    for path in ("/openapi.json", "/docs"):
        answer = _get(server, path, token=False)
        assert answer.status == 401 and answer.error()["field"] == "Authorization"
        assert answer.headers["www-authenticate"] == 'Bearer realm="snapref-ray"'
        _report(f"GET {path} without token", status=401, ms=round(answer.seconds * 1e3, 1))
    spec = json.loads(_get(server, "/openapi.json").body)
    assert spec["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "The server's token: `Authorization: Bearer <token>`.",
    }
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            expected = [] if path == "/v1/health" else [{"bearerAuth": []}]
            assert operation.get("security", []) == expected, (path, method)
    assert {
        "/v1/render",
        "/v1/references",
        "/v1/health",
        "/v1/models",
        "/v1/images/generations",
        "/v1/images/edits",
    } == set(spec["paths"])
    docs = _get(server, "/docs")
    assert docs.status == 200 and docs.headers["content-type"].startswith("text/html")
    assert b'"bearerAuth"' in docs.body and b"SwaggerUIBundle" in docs.body  # the spec is inlined
    _assert_serving(server)


# -- 6. logs -------------------------------------------------------------------------------------
_SERVER_LOGS: LogMark | None = None  # Ray's log files as they were before this module's server started


def _replica_logs(deployment: str) -> str:
    """Everything the module's replicas of `deployment` logged."""
    pattern = f"serve/replica_*{deployment}*.log"
    assert _SERVER_LOGS.files(pattern), f"no Serve log file for {deployment} under {_SERVER_LOGS.logs_dir}"
    return _SERVER_LOGS.since(pattern)


def _worker_stderr() -> str:
    """What Ray's workers wrote to stderr (where a root-logger traceback goes) since the module's server started."""
    return _SERVER_LOGS.since("worker-*.err")


def _wait_for_log(deployment: str, needle: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = _replica_logs(deployment)
        if needle in text or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


@pytest.mark.slow
def test_disconnect_mid_body_is_an_info_line_and_replica_400s_are_not_crashes(server: int, reference_id: str) -> None:
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server), timeout=SOCKET_TIMEOUT) as sock:
            sock.sendall(
                _request(
                    "POST",
                    "/v1/render",
                    b'{"prompt": "half',
                    {"Authorization": AUTH, "Content-Type": "application/json"},
                    content_length=1000,
                )
            )
            time.sleep(0.2)
        # closed with 984 bytes still owed
    ingress_log = _wait_for_log("SnapRefIngress", "client disconnected after")
    lines = [line for line in ingress_log.splitlines() if "client disconnected after" in line]
    assert lines and all(line.startswith("INFO ") for line in lines), lines
    assert "unexpected error" not in ingress_log and "Traceback" not in ingress_log, ingress_log[-3000:]
    # Worker stderr (where a root-logger traceback goes) also carries other processes' noise: look for
    # the marks of this failure only.
    stderr = _worker_stderr()
    for mark in ("unexpected error in", "TaskCancelledError", "ClientDisconnect"):
        assert mark not in stderr, stderr[-3000:]

    answer = _post_json(
        server, "/v1/render", {"prompt": "p", "reference_id": reference_id, "ref_megapixels": 0.0002, **SMALL}
    )
    assert answer.status == 400 and answer.error()["field"] == "ref_megapixels"
    time.sleep(1.0)  # log lines are flushed asynchronously
    from snapref_ray.pipelines.serve_app import rendering_deployment

    renderer_log = _replica_logs(rendering_deployment(ServeConfig(model="m", **CONFIG)))
    assert "Traceback" not in renderer_log and " ERROR " not in renderer_log, renderer_log[-3000:]
    assert "ApiError" not in _worker_stderr()
    _assert_serving(server, reference_id)
