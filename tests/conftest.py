"""Shared fixtures: the tiny model set (built once per session), the real tokenizer files, S3."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["tests.s3_server"]

SHARED = Path(__file__).resolve().parents[2] / "shared"
# CI lays shared/ beside the clone; a developer checkout has it at ../shared too.
SHARED = Path(os.environ.get("SNAPREF_SHARED", SHARED))


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.fail(f"the shared folder (real key listings, tokenizers) is missing at {SHARED}; set SNAPREF_SHARED")
    return SHARED


@pytest.fixture(scope="session")
def real_tokenizer_dirs(shared_dir: Path) -> tuple[Path, Path]:
    return shared_dir / "tokenizers" / "qwen", shared_dir / "tokenizers" / "t5"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """A complete tiny model set in the real file layouts (see snapref_ray/tiny.py)."""
    from snapref_ray.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def tiny_renderer(tiny_models: Path):
    from snapref_ray.engine import Renderer

    return Renderer.from_folder(tiny_models, device="cpu")
