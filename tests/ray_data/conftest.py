"""One local Ray per module for the Ray Data tests, wired to the SeaweedFS test server through the AWS environment.

Ray Data's own S3 reads and writes (pyarrow) and the renderer's model and reference reads (boto3)
both take the endpoint and credentials from the standard variables, as on a real cluster; they are
set in the driver (restored afterwards) and in every Ray worker.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FAST_SETTINGS = {"width": 256, "height": 256, "steps": 2, "cfg": 1.0, "sampler": "euler"}


@pytest.fixture(scope="module")
def ray_s3_env(s3_server, tmp_path_factory) -> Iterator[dict[str, str]]:
    """A local Ray (8 logical CPUs) whose driver and workers see the S3 test server as "AWS"."""
    import ray

    env = {
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        # s3:// model folders are mirrored here, not in the user's ~/.cache.
        "SNAPREF_RAY_CACHE": str(tmp_path_factory.mktemp("model-cache")),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if ray.is_initialized():  # a previous module's teardown failed: never attach to a stale one
        ray.shutdown()
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {**env, "PYTHONPATH": pythonpath}},
    )
    try:
        yield env
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
