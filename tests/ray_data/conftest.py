"""The Ray Data tests' job on the session's local Ray, wired to the SeaweedFS test server through the AWS environment.

Ray Data's own S3 reads and writes (pyarrow) and the renderer's model and reference reads (boto3)
both take the endpoint and credentials from the standard variables, as on a real cluster: the session's
local Ray runs with them (tests/conftest.py `local_ray_environment`), and the driver has them for the
module (restored afterwards).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FAST_SETTINGS = {"width": 256, "height": 256, "steps": 2, "cfg": 1.0, "sampler": "euler"}


@pytest.fixture(scope="module")
def ray_s3_env(local_ray, local_ray_environment) -> Iterator[dict[str, str]]:
    """The session's local Ray (8 logical CPUs), whose processes see the S3 test server as "AWS" and mirror
    s3:// model folders into the session's cache (`local_ray_environment`); this process too, for the module."""
    env = dict(local_ray_environment)
    with local_ray(env, driver_env=True, log_to_driver=False):
        yield env
