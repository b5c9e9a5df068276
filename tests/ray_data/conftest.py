"""The Ray Data tests' job on the session's local Ray, wired to the SeaweedFS test server through the AWS environment.

Ray Data's own S3 reads and writes (pyarrow) and the renderer's model and reference reads (boto3)
both take the endpoint and credentials from the standard variables, as on a real cluster; they are
set in the driver (restored afterwards) and in the module's job, so in every worker it starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FAST_SETTINGS = {"width": 256, "height": 256, "steps": 2, "cfg": 1.0, "sampler": "euler"}


@pytest.fixture(scope="module")
def ray_s3_env(local_ray, s3_server, tmp_path_factory) -> Iterator[dict[str, str]]:
    """The session's local Ray (8 logical CPUs) whose driver and workers see the S3 test server as "AWS"."""
    env = {
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        # s3:// model folders are mirrored here, not in the user's ~/.cache.
        "SNAPREF_RAY_CACHE": str(tmp_path_factory.mktemp("model-cache")),
    }
    with local_ray(env, driver_env=True, log_to_driver=False):
        yield env
