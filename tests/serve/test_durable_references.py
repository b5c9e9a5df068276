"""Serve in production: references stored durably and shared, model folders from s3://.

The live module runs its application on the session's local Serve (tests/conftest.py: the S3 test
server's credentials are in its processes' environment, as on a cluster node) with models from the
real SeaweedFS S3 server (`s3_server` fixture) and references stored under an s3:// prefix on it,
with two ReferenceStore replicas. A whole redeploy of the application (every replica new, every cache
empty) must still render an id uploaded before it, without a re-upload.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import pytest

from snapref_ray.client import ApiError as ClientError
from snapref_ray.client import SnapRefClient
from snapref_ray.serve.api import ReferenceInfo
from snapref_ray.serve.config import ServeConfig, ServeLimits
from snapref_ray.serve.reference_store import DurableReferences

SMALL = {"width": 256, "height": 256, "steps": 1}


def _info(data: bytes, reference_id: str = "ab" * 16) -> ReferenceInfo:
    return ReferenceInfo(
        reference_id=reference_id,
        content_hash=hashlib.sha256(data).hexdigest(),
        width=16,
        height=16,
        ref_megapixels=1.0,
        ref_caption="c",
        bytes=len(data),
    )


def test_durable_references_are_content_addressed_and_keyed_safely(tmp_path: Path) -> None:
    store = DurableReferences(str(tmp_path / "refs"))
    data = b"png bytes"
    info = _info(data)
    store.put(info, data)
    store.put(info, data)  # idempotent: same id, same bytes
    assert (tmp_path / "refs" / "files" / info.content_hash).read_bytes() == data
    assert (
        json.loads((tmp_path / "refs" / "references" / f"{info.reference_id}.json").read_text())["ref_caption"] == "c"
    )
    again = DurableReferences(str(tmp_path / "refs"))  # a new process over the same folder
    assert again.info(info.reference_id) == info and again.file(info.content_hash) == data
    assert again.info("cd" * 16) is None and again.file("0" * 64) is None
    # Client-supplied ids never become paths: malformed ones are simply unknown.
    for hostile in ("../../etc/passwd", "AB" * 16, "a" * 33, "", "references/x"):
        assert again.info(hostile) is None
    assert again.file("../" + info.content_hash) is None


def test_more_store_replicas_need_durable_storage() -> None:
    with pytest.raises(ValueError, match="reference_store_replicas=2 needs references_uri"):
        ServeConfig(model="m", reference_store_replicas=2)
    ServeConfig(model="m", reference_store_replicas=2, references_uri="s3://b/refs")


@pytest.fixture(scope="module")
def s3_serve(local_serve, tiny_models: Path, s3_server, tmp_path_factory):
    """(client, config, s3 prefix of the references) for a Serve with models and references on S3."""
    run = uuid.uuid4().hex[:8]
    s3 = s3_server.client()
    for path in tiny_models.rglob("*"):
        if path.is_file():
            s3.put_object(
                Bucket=s3_server.bucket,
                Key=f"models-{run}/tiny/{path.relative_to(tiny_models)}",
                Body=path.read_bytes(),
            )
    # Credentials reach the replicas as on a cluster node: through the environment, never the config.
    assert local_serve.env["AWS_SECRET_ACCESS_KEY"] == s3_server.secret_key
    config = ServeConfig(
        model=f"s3://{s3_server.bucket}/models-{run}/tiny",
        port=local_serve.port,
        references_uri=f"s3://{s3_server.bucket}/refs-{run}",
        reference_store_replicas=2,
        s3={"endpoint_url": s3_server.endpoint_url, "region": "us-east-1"},
        model_cache_dir=str(tmp_path_factory.mktemp("model-cache")),
        min_replicas=1,
        max_replicas=1,
        max_batch=2,
        limits=ServeLimits(max_n=2),
        request_timeout_s=120,
    )
    with local_serve.deployed(config) as url:
        yield SnapRefClient(url, timeout=120, retries=0), config, f"refs-{run}"


@pytest.mark.slow
def test_models_from_s3_and_references_survive_a_redeploy(s3_serve, s3_server, tiny_models: Path) -> None:
    from ray import serve

    from snapref_ray.serve.app import APP_NAME, build_app

    client, config, prefix = s3_serve
    png = (tiny_models / "reference.png").read_bytes()
    info = client.upload_reference_info(png, ref_caption="durable")
    first = client.render("1girl", reference_id=info["reference_id"], response_format="json", **SMALL)
    assert first["reference_ids"] == [info["reference_id"]] and first["cache_hit"] is False
    # Stored content-addressed on S3.
    s3 = s3_server.client()
    body = s3.get_object(Bucket=s3_server.bucket, Key=f"{prefix}/files/{info['content_hash']}")["Body"].read()
    assert body == png
    stored = json.loads(
        s3.get_object(Bucket=s3_server.bucket, Key=f"{prefix}/references/{info['reference_id']}.json")["Body"].read()
    )
    assert stored == info

    # Every replica replaced (ingress, both stores, renderer): all in-memory state is gone.
    serve.delete(APP_NAME)
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    again = client.render("1girl", reference_id=info["reference_id"], response_format="json", seed=1, **SMALL)
    assert again["reference_ids"] == [info["reference_id"]]
    assert again["cache_hit"] is False and again["cache"]["encodes"] == 1  # re-encoded from the stored file
    pair = client.render(
        "2girls",
        left_reference_id=info["reference_id"],
        right_reference_id=info["reference_id"],
        response_format="json",
        **SMALL,
    )
    assert len(pair["images"]) == 1
    # An id that was never uploaded is still a 404, not a storage error.
    with pytest.raises(ClientError) as err:
        client.render("x", reference_id="0" * 32, **SMALL)
    assert (err.value.status, err.value.field) == (404, "reference_id")
    # The model files came from S3 into the per-node cache.
    cached = [p for p in Path(config.model_cache_dir).rglob("*") if p.is_file() and p.name == "dit.safetensors"]
    assert cached and cached[0].read_bytes() == (tiny_models / "dit.safetensors").read_bytes()
