"""The session's S3 server fixture (a pytest plugin of tests/conftest.py): benchmarks/s3_server.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.s3_server import SeaweedServer, run_seaweedfs


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[SeaweedServer]:
    """One SeaweedFS S3 server for the session; tests keep apart by using their own key prefixes."""
    with run_seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server
