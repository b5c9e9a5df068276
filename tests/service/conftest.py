"""Fixtures of the render service's tests: a service over the session's tiny renderer, and its reference image."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapref_ray.render_service.service import RenderService


@pytest.fixture
def service(tiny_renderer) -> RenderService:
    return RenderService(tiny_renderer)


@pytest.fixture(scope="module")
def reference_png(tiny_models: Path) -> bytes:
    return (tiny_models / "reference.png").read_bytes()
