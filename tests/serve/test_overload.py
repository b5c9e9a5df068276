"""Overload on a real local Serve: past a small queue, requests get 503 + Retry-After at once while
the admitted ones complete."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pytest
from PIL import Image

from snapref_ray.client import SnapRefClient
from snapref_ray.serve.config import ServeConfig, ServeLimits
from snapref_ray.serve.errors import ApiError

RETRY_AFTER_S = 3
BURST = 8
# Slow enough (seconds on a CPU) that the burst arrives while the first admitted request renders.
SLOW = {"width": 512, "height": 512, "steps": 50}


# Both topologies refuse alike: the split ingress through Serve's router queue, the fused replica
# through its own admission count.
@pytest.fixture(scope="module", params=["fused", "split"])
def server(request, local_serve, tiny_models: Path):
    config = ServeConfig(
        model=str(tiny_models),
        port=local_serve.port,
        topology=request.param,
        min_replicas=1,
        max_replicas=1,
        max_ongoing_requests=1,
        max_queued_requests=1,
        max_batch=1,
        batch_wait_timeout_s=0,
        retry_after_s=RETRY_AFTER_S,
        limits=ServeLimits(max_n=1, max_steps=200, max_side=512),
        request_timeout_s=120,
    )
    with local_serve.deployed(config) as url:
        yield url


@pytest.fixture(scope="module")
def reference_id(server: str, tiny_models: Path) -> str:
    client = SnapRefClient(server, timeout=120, retries=0)
    ref = client.upload_reference((tiny_models / "reference.png").read_bytes())
    client.render("warm-up", reference_id=ref, width=256, height=256, steps=1)  # encode before the burst
    return ref


def _post(url: str, body: dict):
    request = Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urlopen(request, timeout=120) as r:
            return r.status, r.headers, r.read(), time.monotonic()
    except HTTPError as e:
        return e.code, e.headers, e.read(), time.monotonic()


@pytest.mark.slow
def test_burst_gets_prompt_503s_while_admitted_requests_complete(server: str, reference_id: str) -> None:
    barrier = threading.Barrier(BURST)

    def send(seed: int):
        barrier.wait(timeout=30)
        return _post(server + "/v1/render", {"prompt": "1girl", "seed": seed, "reference_id": reference_id, **SLOW})

    with ThreadPoolExecutor(BURST) as pool:
        results = list(pool.map(send, range(BURST)))
    statuses = sorted(status for status, *_ in results)
    ok = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] == 503]
    assert len(ok) + len(rejected) == BURST, statuses
    # One renders and one waits (max_ongoing_requests=1, max_queued_requests=1): the rest are refused (a split
    # ingress may also hold one on its way to the router).
    assert 1 <= len(ok) <= 3 and len(rejected) >= BURST - 3, statuses
    for _, headers, body, _ in rejected:
        assert headers["Retry-After"] == str(RETRY_AFTER_S)
        error = json.loads(body)["error"]
        assert error["field"] is None and "at capacity" in error["message"]
    for _, headers, body, _ in ok:
        assert headers["Content-Type"] == "image/png" and Image.open(io.BytesIO(body)).size == (512, 512)
    # Promptly: every refusal was answered before the first admitted render finished.
    assert max(t for *_, t in rejected) < min(t for *_, t in ok)


@pytest.mark.slow
def test_server_recovers_after_the_burst(server: str, reference_id: str) -> None:
    status, headers, body, _ = _post(
        server + "/v1/render",
        {"prompt": "after", "reference_id": reference_id, "width": 256, "height": 256, "steps": 2},
    )
    assert status == 200 and headers["X-Cache-Hit"] == "true"


def _maps_libtorch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)


@pytest.mark.slow
def test_only_the_replicas_that_render_load_torch(server: str, reference_id: str, request) -> None:
    """After uploads and renders went through it, a split ingress has no libtorch in its address space (it parses,
    checks and routes; torch costs a replica about 3 CPU-seconds to import and 200 MB), nor has the ReferenceStore;
    the replicas that render have it. Same machine: the replicas' /proc is readable here."""
    from ray._private import state  # the GCS's actor table: this Serve's Ray runs no dashboard for the state API

    from snapref_ray.serve.app import APP_NAME

    loads = {}
    for actor in state.actors().values():
        prefix, _, deployment = actor["ActorClassName"].rpartition(":")
        if actor["State"] == "ALIVE" and prefix == f"ServeReplica:{APP_NAME}":
            loads.setdefault(deployment, set()).add(_maps_libtorch(actor["Pid"]))
    if "fused" in request.node.callspec.id:
        assert loads == {"SnapRefIngress": {True}, "ReferenceStore": {False}}, loads
    else:
        assert loads == {"SnapRefIngress": {False}, "Renderer": {True}, "ReferenceStore": {False}}, loads


def test_check_health_fails_only_when_the_device_is_stuck(tiny_renderer) -> None:
    from snapref_ray.render_service.service import RenderService
    from snapref_ray.serve.renderer import ReplicaRenderer

    replica = object.__new__(ReplicaRenderer)  # the health logic on a real render service, no Serve
    replica._config = ServeConfig(model="m", stall_timeout_s=60)
    replica.service = service = RenderService(tiny_renderer)
    service._health.last_progress = time.monotonic() - 3600
    replica.check_health()  # idle for an hour: healthy
    with service.device("render"):
        replica.check_health()  # just started
        service._health.last_progress = time.monotonic() - 120
        service.tick(1, 30)  # a long render that keeps finishing steps: healthy
        replica.check_health()
        service._health.last_progress = time.monotonic() - 120  # no step for two minutes
        with pytest.raises(RuntimeError, match=r"renderer stalled: the device has made no progress for 12\d s"):
            replica.check_health()
    replica.check_health()  # the device was let go: healthy again


def test_a_fused_replica_admits_renders_up_to_its_slots_and_cancels_them_on_timeout() -> None:
    from snapref_ray.serve.render_path import RenderPath

    class _SlowRenderer:  # the replica's own renderer, stuck on the device
        started = cancelled = 0

        async def render(self, job):
            self.started += 1
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

    config = ServeConfig(
        model="m",
        topology="fused",
        max_ongoing_requests=1,
        max_queued_requests=1,
        request_timeout_s=0.3,
        retry_after_s=2,
    )
    # The admission logic alone: no model, no ASGI app, no store.
    slow = _SlowRenderer()
    path = RenderPath(config, renderer=None, local=slow, store=None)

    async def burst():
        return await asyncio.gather(*(path.render_call(None) for _ in range(5)), return_exceptions=True)

    results = asyncio.run(burst())
    assert all(isinstance(r, ApiError) for r in results), results
    assert sorted(r.status for r in results) == [503, 503, 503, 504, 504]
    for refused in (r for r in results if r.status == 503):
        assert refused.headers == {"Retry-After": "2"} and "at capacity" in refused.message
    # The two admitted renders were cancelled at request_timeout_s (the device loop then drops them),
    # and their slots are free again.
    assert (slow.started, slow.cancelled, path._rendering) == (2, 2, 0)
