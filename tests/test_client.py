"""SnapRefClient against a scripted HTTP server on 127.0.0.1: what it sends again and what it does not.

The server answers each connection from a script: drop it after reading the request (a replica that
died holding it), answer as the front does (plain-text 5xx), answer as the API does (JSON error), hang
past the client's timeout, or answer 200. Every request it read is recorded, so the tests count sends.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from snapref_ray.client import ApiError, SnapRefClient
from tests.raw_http import read_head, read_request, reset

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16


def _response(status: int, reason: str, body: bytes, content_type: str, extra: str = "") -> bytes:
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        f"{extra}Connection: close\r\n\r\n"
    )
    return head.encode() + body


DROP = "drop"
HANG = "hang"
OK_PNG = _response(200, "OK", PNG, "image/png")
FRONT_500 = _response(500, "Internal Server Error", b"Internal Server Error", "text/plain")  # HAProxy, via Serve
FRONT_502 = _response(502, "Bad Gateway", b"Bad Gateway", "text/plain")
API_500 = _response(
    500,
    "Internal Server Error",
    json.dumps({"error": {"field": None, "message": "internal error: KeyError"}}).encode(),
    "application/json",
)
API_503 = _response(
    503,
    "Service Unavailable",
    json.dumps({"error": {"field": None, "message": "at capacity, retry later"}}).encode(),
    "application/json",
    "Retry-After: 2\r\n",
)


@contextmanager
def scripted_server(*answers: bytes | str) -> Iterator[tuple[str, list[bytes]]]:
    """A server on 127.0.0.1 that gives the n-th connection the n-th answer; yields (url, requests read)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    seen: list[bytes] = []
    release = threading.Event()

    listener.settimeout(0.1)  # so that the thread sees `release` when answers are left unused

    def serve() -> None:
        for answer in answers:
            while True:
                try:
                    conn, _ = listener.accept()
                    break
                except TimeoutError:
                    if release.is_set():
                        return
            conn.settimeout(None)
            with conn:
                head = read_head(conn)
                if head is None:
                    continue
                seen.append(read_request(conn, head))
                if answer == DROP:
                    reset(conn)
                elif answer == HANG:
                    release.wait(30)
                else:
                    conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", seen
    finally:
        release.set()
        thread.join(5)
        listener.close()


def _client(url: str, **options) -> SnapRefClient:
    return SnapRefClient(url, token="", retry_wait_s=0.01, **options)


def test_a_call_that_met_a_lost_replica_is_sent_again_until_it_is_answered() -> None:
    with scripted_server(DROP, FRONT_500, OK_PNG) as (url, seen):
        assert _client(url).render("1girl", reference_id="r" * 16, width=256) == PNG
    assert len(seen) == 3
    assert len(set(seen)) == 1 and seen[0].startswith(b"POST /v1/render ")  # the same request each time
    assert json.loads(seen[0].split(b"\r\n\r\n", 1)[1]) == {
        "prompt": "1girl",
        "seed": 0,
        "n": 1,
        "reference_id": "r" * 16,
        "width": 256,
    }


def test_uploads_are_sent_again_too() -> None:
    upload = _response(200, "OK", json.dumps({"reference_id": "abc"}).encode(), "application/json")
    with scripted_server(FRONT_502, upload) as (url, seen):
        assert _client(url).upload_reference(PNG) == "abc"
    assert len(seen) == 2 and seen[0] == seen[1]


def test_after_its_retries_the_fronts_answer_reaches_the_caller() -> None:
    with scripted_server(FRONT_502, FRONT_502, FRONT_502, OK_PNG) as (url, seen):
        with pytest.raises(ApiError) as info:
            _client(url, retries=2).render("1girl")
    assert len(seen) == 3
    assert (info.value.status, info.value.field, info.value.message) == (502, None, "Bad Gateway")


def test_without_retries_a_dropped_connection_is_the_callers() -> None:
    with scripted_server(DROP, OK_PNG) as (url, seen):
        with pytest.raises(ConnectionError):
            _client(url, retries=0).render("1girl")
    assert len(seen) == 1


@pytest.mark.parametrize("answer, status", [(API_500, 500), (API_503, 503)], ids=["500", "503"])
def test_the_apis_own_errors_are_not_sent_again(answer: bytes, status: int) -> None:
    with scripted_server(answer, OK_PNG) as (url, seen):
        with pytest.raises(ApiError) as info:
            _client(url).render("1girl")
    assert len(seen) == 1 and info.value.status == status
    if status == 503:  # at capacity: when to come back is the caller's decision
        assert info.value.retry_after == 2.0 and info.value.message == "at capacity, retry later"


def test_a_timeout_is_not_sent_again() -> None:
    """A render that outlived the client's timeout may still be running: sending it again would double it."""
    with scripted_server(HANG, OK_PNG) as (url, seen):
        with pytest.raises((TimeoutError, OSError)) as info:
            _client(url, timeout=0.5).render("1girl")
        assert not isinstance(info.value, ConnectionError), info.value
    assert len(seen) == 1
