"""Batching on a real local Serve: concurrent compatible requests share one forward, others never mix."""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from snapref_ray.client import SnapRefClient
from snapref_ray.serve.config import ServeConfig, ServeLimits

SMALL = {"width": 256, "height": 256, "steps": 2}
MAX_BATCH = 4


@pytest.fixture(scope="module")
def client(local_serve, tiny_models: Path):
    # No token on loopback (allowed); a wide wait window so requests sent together surely meet.
    config = ServeConfig(
        model=str(tiny_models),
        port=local_serve.port,
        min_replicas=1,
        max_replicas=1,
        max_batch=MAX_BATCH,
        max_ongoing_requests=12,
        max_queued_requests=32,
        batch_wait_timeout_s=0.5,
        limits=ServeLimits(max_n=MAX_BATCH),
        request_timeout_s=120,
    )
    with local_serve.deployed(config) as url:
        yield SnapRefClient(url, timeout=120, retries=0)


@pytest.fixture(scope="module")
def references(client: SnapRefClient, tiny_models: Path) -> list[str]:
    data = (tiny_models / "reference.png").read_bytes()
    refs = [client.upload_reference(data), client.upload_reference(data, ref_caption="second")]
    for ref in refs:  # encode both up front, so the requests below start together
        client.render("warm-up", reference_id=ref, response_format="json", **SMALL)
    return refs


def _together(client: SnapRefClient, bodies: list[dict]) -> list[dict]:
    """Send all bodies at the same moment from separate threads; the JSON answers in order."""
    barrier = threading.Barrier(len(bodies))

    def send(body: dict) -> dict:
        barrier.wait(timeout=30)
        return client.render(response_format="json", **body)

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(send, bodies))


def _by_batch(answers: list[dict]) -> dict[str, list[dict]]:
    batches = defaultdict(list)
    for a in answers:
        batches[a["batch_id"]].append(a)
    return batches


def _check_accounting(answers: list[dict]) -> None:
    """Every answer's batch_size / batched_requests match the answers that rode in its batch."""
    for batch in _by_batch(answers).values():
        assert {a["batched_requests"] for a in batch} == {len(batch)}
        assert {a["batch_size"] for a in batch} == {sum(len(a["seeds"]) for a in batch)}
        assert batch[0]["batch_size"] <= MAX_BATCH


@pytest.mark.slow
def test_concurrent_compatible_requests_are_batched(client: SnapRefClient, references: list[str]) -> None:
    answers = _together(
        client, [{"prompt": f"1girl, scene {i}", "seed": i, "reference_id": references[0], **SMALL} for i in range(4)]
    )
    _check_accounting(answers)
    assert max(a["batch_size"] for a in answers) > 1
    assert len(_by_batch(answers)) < 4
    assert all(a["cache_hit"] for a in answers)
    assert sorted(a["seeds"][0] for a in answers) == [0, 1, 2, 3]  # each got its own image back


@pytest.mark.slow
def test_incompatible_requests_never_share_a_forward(client: SnapRefClient, references: list[str]) -> None:
    bodies = (
        [{"prompt": "a", "reference_id": references[0], **SMALL} for _ in range(2)]
        + [{"prompt": "b", "reference_id": references[0], **SMALL, "steps": 3} for _ in range(2)]
        + [{"prompt": "c", "reference_id": references[1], **SMALL} for _ in range(2)]
        + [{"prompt": "d", "reference_id": references[0], **SMALL, "negative_prompt": "blurry"}]
    )
    answers = _together(client, bodies)
    _check_accounting(answers)
    for batch in _by_batch(answers).values():
        assert len({a["settings"]["steps"] for a in batch}) == 1
        assert len({tuple(a["reference_ids"]) for a in batch}) == 1
    assert max(a["batch_size"] for a in answers) > 1
    # A negative prompt is per request, as in a batch job (each row has its own uncond context): it may share
    # a forward, and each request is rendered with its own.
    assert [a["settings"]["negative_prompt"] for a in answers] == [""] * 6 + ["blurry"]


@pytest.mark.slow
def test_batches_count_images_not_requests(client: SnapRefClient, references: list[str]) -> None:
    answers = _together(
        client, [{"prompt": "p", "reference_id": references[0], "n": n, "seed": 10 * n, **SMALL} for n in (3, 2, 2, 1)]
    )
    _check_accounting(answers)  # includes batch_size <= MAX_BATCH images
    assert sorted(len(a["images"]) for a in answers) == [1, 2, 2, 3]
    assert {a["seeds"][0]: a["seeds"] for a in answers}[30] == [30, 31, 32]
