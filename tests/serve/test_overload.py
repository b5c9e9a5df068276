"""Overload on a real local Serve: past a small queue, requests get 503 + Retry-After at once while
the admitted ones complete."""

from __future__ import annotations

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
from tests.serve.conftest import free_port

RETRY_AFTER_S = 3
BURST = 8
# Slow enough (seconds on a CPU) that the burst arrives while the first admitted request renders.
SLOW = {"width": 512, "height": 512, "steps": 100}


@pytest.fixture(scope="module")
def server(tiny_models: Path):
    from snapref_ray.pipelines.serve_app import start_local, stop_local

    config = ServeConfig(models_dir=str(tiny_models), port=free_port(), min_replicas=1, max_replicas=1,
                         max_ongoing_requests=1, max_queued_requests=1, max_batch_size=1, batch_wait_timeout_s=0,
                         retry_after_s=RETRY_AFTER_S, limits=ServeLimits(max_n=1, max_steps=200, max_side=512),
                         request_timeout_s=120)
    try:
        yield start_local(config, num_cpus=6)
    finally:
        stop_local(drain=False)  # the local Ray goes with it; nothing is in flight


@pytest.fixture(scope="module")
def reference_id(server: str, tiny_models: Path) -> str:
    client = SnapRefClient(server, timeout=120)
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
    # One renders and one waits (max_ongoing_requests=1, max_queued_requests=1): the rest are refused.
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
    status, headers, body, _ = _post(server + "/v1/render", {"prompt": "after", "reference_id": reference_id,
                                                             "width": 256, "height": 256, "steps": 2})
    assert status == 200 and headers["X-Cache-Hit"] == "true"


def test_check_health_fails_only_when_the_device_is_stuck() -> None:
    from snapref_ray.serve.renderer import RendererDeployment

    replica = object.__new__(RendererDeployment.func_or_class)  # the health logic alone, no model
    replica._config = ServeConfig(models_dir="m", stall_timeout_s=60)
    now = time.monotonic()
    replica._busy_since, replica._last_progress = None, now - 3600
    replica.check_health()  # idle for an hour: healthy
    replica._busy_since, replica._last_progress = now - 3600, now - 1
    replica.check_health()  # a long render that keeps finishing steps: healthy
    replica._last_progress = now - 120
    with pytest.raises(RuntimeError, match=r"renderer stalled: the device has made no progress for 12\d s"):
        replica.check_health()

