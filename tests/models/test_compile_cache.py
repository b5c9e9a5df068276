"""A compile cache that holds something wrong never stops a worker: it warns once and the graphs compile.

The cache's good path (a second process with an empty inductor cache loads the graph and builds nothing; two
publishers racing leave one artifact) runs with the suite's one inductor compile, in
tests/models/test_compiled.py::test_compiled_forward_equals_eager_and_a_new_node_loads_it_from_the_compile_cache.
"""

from __future__ import annotations

import io
import json
import logging
import tarfile
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch._dynamo.testing import CompileCounter

from snapref_ray.models.compile_cache import ARTIFACT_SUFFIX, CompileCache, CompileKey
from snapref_ray.models.compiled import compile_forward
from snapref_ray.storage.backends import open_storage
from tests.models.test_compiled import _inputs, make_dit

MAGIC = b"snapref-ray compile cache v2\n"


def _artifact(key: CompileKey, megacache: bytes, kernels: bytes = b"") -> bytes:
    header = json.dumps({"key": asdict(key), "megacache": len(megacache)}, sort_keys=True).encode()
    return MAGIC + header + b"\n" + megacache + kernels


def _escaping_kernel_archive() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        data = b"not a kernel"
        info = tarfile.TarInfo("../../outside-the-cache.so")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_corrupt_mismatched_and_escaping_artifacts_are_skipped_with_one_warning(tmp_path: Path, caplog, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor" / "cache"))
    dit = make_dit()
    key = CompileKey.for_dit(dit, "none")
    folder = tmp_path / "shared" / key.digest
    folder.mkdir(parents=True)
    other_torch = replace(key, torch="1.0.0")
    bad = {
        "garbage": b"\x00\x01 not an artifact",
        "truncated": _artifact(key, b"x" * 100)[:-40],
        "corrupt-megacache": _artifact(key, b"this is not torch's mega-cache"),
        "other-torch": _artifact(other_torch, b"whatever"),
        "escaping-kernels": _artifact(key, b"", _escaping_kernel_archive()),
    }
    for name, data in bad.items():
        (folder / f"{name}{ARTIFACT_SUFFIX}").write_bytes(data)

    counter = CompileCounter()
    forward = compile_forward(
        dit, backend=counter, cache=CompileCache(tmp_path / "shared", key, open_store=open_storage)
    )
    x, sigma, ctx = _inputs(2, 1)
    # torch's own loggers propagate or not depending on what ran before (torch._logging): make them propagate, so
    # that a torch warning reaching the user would be seen here whatever the test order.
    monkeypatch.setattr(logging.getLogger("torch"), "propagate", True)
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        out = forward(x, sigma, ctx)
        eager = dit(x, sigma, ctx)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    assert counter.frame_count == 1  # compiled as if there were no cache
    (warning,) = [r for r in caplog.records if r.name == "snapref_ray.models.compile_cache"]
    assert warning.levelno == logging.WARNING
    # torch's "Failed to un-pickle cache artifacts" (with its traceback) does not reach the user: its reason is in
    # the project's one warning, beside the artifact it concerns.
    assert not [r for r in caplog.records if r.name.startswith("torch.compiler")], caplog.text
    assert "corrupt-megacache.megacache: ValueError: torch could not deserialize the artifacts" in warning.getMessage()
    assert f"ignored {len(bad)} artifact(s)" in warning.getMessage()
    for name in bad:
        assert f"{name}{ARTIFACT_SUFFIX}" in warning.getMessage()
    assert "written for another key" in warning.getMessage() and "'torch': ('1.0.0'" in warning.getMessage()
    assert "not a file inside the inductor cache" in warning.getMessage()
    assert not (tmp_path / "outside-the-cache.so").exists()
    assert forward.stats.artifacts_skipped == len(bad) and forward.stats.artifacts_loaded == 0


def test_the_key_separates_dtypes_quantisation_and_models():
    fp32, bf16 = make_dit(), make_dit(torch.bfloat16)
    keys = {
        CompileKey.for_dit(fp32, "none"),
        CompileKey.for_dit(bf16, "none"),
        CompileKey.for_dit(bf16, "fp8"),
        replace(CompileKey.for_dit(fp32, "none"), model="D2048-H16x128-C1024-M8192-r256"),
    }
    assert len({k.digest for k in keys}) == 4
    assert CompileKey.for_dit(fp32, "none").dtype == "float32" and CompileKey.for_dit(fp32, "none").device == "cpu"
