"""Shared fixtures: the tiny model set (built once per session), the real key listings, the real
tokenizer files, S3 — and the rule that CI never skips.

What the tests need from outside the repository is only the real tokenizer files (they are not
ours to redistribute). They come from `SNAPREF_TOKENIZERS` (a folder holding `qwen/` and `t5/`) or
`SNAPREF_SHARED` (a folder holding `tokenizers/`); without either, the tests that need them skip
and say which variable to set. The real key/shape listings are small facts and live in
`tests/data/ref-keys/`.

`SNAPREF_NO_SKIP=1` (set by `.ci/run`) turns every skip — a missing Chromium, diffusers or
tokenizer folder, a `skipif`, an `importorskip` at module level — into a failure that carries the
skip's reason, so a CI run that passes has run every test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["tests.s3_server"]

DATA_DIR = Path(__file__).resolve().parent / "data"
REF_KEYS_DIR = DATA_DIR / "ref-keys"
NO_SKIP_VAR = "SNAPREF_NO_SKIP"


def _no_skip() -> bool:
    return os.environ.get(NO_SKIP_VAR, "").strip().lower() in {"1", "true", "yes"}


def _as_failure(report, what: str) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"{what} skipped, but {NO_SKIP_VAR}=1 forbids skips: {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if _no_skip() and report.skipped and not hasattr(report, "wasxfail"):
        _as_failure(report, item.nodeid)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if _no_skip() and report.skipped:  # a module-level importorskip / skip(allow_module_level=True)
        _as_failure(report, collector.nodeid or "collection")
    return report


def tokenizer_root() -> tuple[Path | None, str]:
    """(folder holding qwen/ and t5/, or None; where it came from) from the environment."""
    if os.environ.get("SNAPREF_TOKENIZERS"):
        return Path(os.environ["SNAPREF_TOKENIZERS"]), "SNAPREF_TOKENIZERS"
    if os.environ.get("SNAPREF_SHARED"):
        return Path(os.environ["SNAPREF_SHARED"]) / "tokenizers", "SNAPREF_SHARED/tokenizers"
    return None, ""


@pytest.fixture(scope="session")
def ref_keys_dir() -> Path:
    """The real key/shape listings (`key<TAB>shape` per line) of the released files."""
    return REF_KEYS_DIR


@pytest.fixture(scope="session")
def real_tokenizer_dirs() -> tuple[Path, Path]:
    """(qwen_dir, t5_dir) of the real tokenizer files; skips by name when none is configured."""
    root, source = tokenizer_root()
    if root is None:
        pytest.skip(
            "needs the real Qwen/T5 tokenizer files: set SNAPREF_TOKENIZERS=<folder with qwen/ and t5/>"
            " or SNAPREF_SHARED=<folder with tokenizers/>"
        )
    qwen, t5 = root / "qwen", root / "t5"
    missing = [str(p) for p in (qwen / "vocab.json", qwen / "merges.txt", t5 / "tokenizer.json") if not p.is_file()]
    if missing:  # a variable that points at the wrong place is a configuration error, not a skip
        pytest.fail(f"{source}={root}: real tokenizer files missing: {', '.join(missing)}")
    return qwen, t5


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """A complete tiny model set in the real file layouts (see snapref_ray/tiny.py)."""
    from snapref_ray.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def tiny_renderer(tiny_models: Path):
    from snapref_ray.engine import Renderer

    return Renderer.from_folder(tiny_models, device="cpu")
