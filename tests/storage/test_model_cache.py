"""Model files from s3:// land once per node, even when several processes ask at the same moment."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from snapref_ray.storage import model_cache
from snapref_ray.storage.backends import S3Options, StorageError
from snapref_ray.storage.model_cache import cache_path, ensure_local


def _upload(server, data: bytes, name: str = "dit.safetensors") -> str:
    key = f"models/{uuid.uuid4().hex[:8]}/{name}"
    server.client().put_object(Bucket=server.bucket, Key=key, Body=data)
    return f"s3://{server.bucket}/{key}"


def _count_downloads(monkeypatch, log: Path, delay_s: float = 0.0) -> None:
    """Make every download append one line to `log` (and optionally take longer)."""
    real = model_cache._download

    def counting(store, key, tmp):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(delay_s)
        real(store, key, tmp)

    monkeypatch.setattr(model_cache, "_download", counting)


def _worker(uri: str, cache_dir: str, opts: S3Options, log: str, barrier, results) -> None:
    """One 'GPU worker' starting up: counts its downloads, starts with the others, reports path and inode."""
    real = model_cache._download

    def counting(store, key, tmp):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)  # a long download, so the other worker certainly arrives while it runs
        real(store, key, tmp)

    model_cache._download = counting
    barrier.wait(timeout=60)
    path = ensure_local(uri, cache_dir, opts)
    results.put((str(path), path.stat().st_ino, path.read_bytes()[:16]))


def test_local_paths_pass_through(tmp_path):
    f = tmp_path / "dit.safetensors"
    f.write_bytes(b"x")
    assert ensure_local(str(f)) == f
    assert ensure_local(f"file://{f}") == f
    with pytest.raises(StorageError, match=f"model file {tmp_path / 'missing.safetensors'} does not exist"):
        ensure_local(str(tmp_path / "missing.safetensors"))


def test_cache_path_layout(tmp_path, monkeypatch):
    uri = "s3://bucket/models/anima/dit.safetensors"
    # `printf %s "$uri" | sha256sum`, first 24 hex digits: a folder name that must not change between versions
    # (a node's cache would be downloaded again), so it is pinned here, not recomputed by the test.
    digest = "b7fc1866175d9f9a76adb302"
    assert cache_path(uri, tmp_path) == tmp_path / digest / "dit.safetensors"
    monkeypatch.setenv("SNAPREF_RAY_CACHE", str(tmp_path / "env-cache"))
    assert cache_path(uri) == tmp_path / "env-cache" / digest / "dit.safetensors"
    monkeypatch.delenv("SNAPREF_RAY_CACHE")
    assert cache_path(uri) == Path.home() / ".cache" / "snapref-ray" / "models" / digest / "dit.safetensors"


def test_download_once_then_reuse(s3_server, tmp_path, monkeypatch):
    data = os.urandom(300_000)
    uri = _upload(s3_server, data)
    log = tmp_path / "downloads.log"
    _count_downloads(monkeypatch, log)
    path = ensure_local(uri, tmp_path / "cache", s3_server.s3_options())
    assert path == cache_path(uri, tmp_path / "cache") and path.read_bytes() == data
    again = ensure_local(uri, tmp_path / "cache", s3_server.s3_options())
    assert again == path and again.stat().st_ino == path.stat().st_ino
    assert len(log.read_text().splitlines()) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == [".dit.safetensors.source.json", ".lock", "dit.safetensors"]


def test_truncated_or_replaced_cache_entry_is_downloaded_again(s3_server, tmp_path, monkeypatch):
    uri = _upload(s3_server, b"A" * 1000, "vae.safetensors")
    log = tmp_path / "downloads.log"
    _count_downloads(monkeypatch, log)
    opts = s3_server.s3_options()
    path = ensure_local(uri, tmp_path, opts)
    path.write_bytes(b"A" * 10)  # a truncated file (e.g. someone copied over it)
    assert ensure_local(uri, tmp_path, opts).read_bytes() == b"A" * 1000
    # Same size, new content: the ETag tells them apart.
    bucket, key = uri[5:].split("/", 1)
    s3_server.client().put_object(Bucket=bucket, Key=key, Body=b"B" * 1000)
    assert ensure_local(uri, tmp_path, opts).read_bytes() == b"B" * 1000
    assert len(log.read_text().splitlines()) == 3


def test_missing_object(s3_server, tmp_path):
    uri = f"s3://{s3_server.bucket}/models/none/x.safetensors"
    with pytest.raises(StorageError, match=f"model file {uri} does not exist"):
        ensure_local(uri, tmp_path, s3_server.s3_options())
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_concurrent_processes_download_once(s3_server, tmp_path):
    data = os.urandom(2_000_000)
    uri = _upload(s3_server, data)
    log = tmp_path / "downloads.log"
    ctx = mp.get_context("spawn")  # no fork of a process that runs threads (boto3, pytest-timeout)
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker, args=(uri, str(tmp_path / "cache"), s3_server.s3_options(), str(log), barrier, results)
        )
        for _ in range(3)
    ]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len(log.read_text().splitlines()) == 1  # one GET for three workers
    expected = str(cache_path(uri, tmp_path / "cache"))
    assert {g[0] for g in got} == {expected}
    assert len({g[1] for g in got}) == 1  # all three hold the same file (one inode: nobody replaced it)
    assert {g[2] for g in got} == {data[:16]}
    assert Path(expected).read_bytes() == data
    assert [p.name for p in Path(expected).parent.iterdir() if ".part-" in p.name] == []


@pytest.mark.slow
def test_cached_copy_is_used_when_the_store_is_unreachable(s3_server, tmp_path):
    uri = _upload(s3_server, b"weights" * 100, "te.safetensors")
    path = ensure_local(uri, tmp_path, s3_server.s3_options())
    never_fetched = _upload(s3_server, b"other", "other.safetensors")
    down = s3_server.s3_options(max_attempts=1, outage_tolerance_s=0.5)
    s3_server.stop(graceful=False)
    try:
        assert ensure_local(uri, tmp_path, down) == path
        with pytest.raises(StorageError, match=rf"HEAD {never_fetched} failed for 0.5 s"):
            ensure_local(never_fetched, tmp_path, down)
    finally:
        s3_server.start()


def test_named_files_are_checked_without_a_download(s3_server, tmp_path, monkeypatch):
    """render_service/loading.py `check_named_files`: an s3:// LoRA is found by one HEAD (nothing downloaded), a
    missing one, local or s3://, is one StorageError naming it."""
    from snapref_ray.model_spec import LoRASpec, ModelSpec
    from snapref_ray.render_service.loading import check_named_files

    log = tmp_path / "downloads.log"
    _count_downloads(monkeypatch, log)
    there = _upload(s3_server, b"lora", "style.safetensors")
    gone = there.replace("style.safetensors", "styel.safetensors")
    local = tmp_path / "local-lora.safetensors"  # a local LoRA's keys are read from its header too
    save_file(
        {
            "diffusion_model.blocks.0.self_attn.q_proj.lora_down.weight": np.zeros((2, 8), np.float32),
            "diffusion_model.blocks.0.self_attn.q_proj.lora_up.weight": np.zeros((8, 2), np.float32),
        },
        str(local),
    )
    spec = ModelSpec(models_dir=str(tmp_path), loras=(LoRASpec(path=there), LoRASpec(path=str(local))))
    check_named_files(spec, s3=s3_server.s3_options())
    assert not log.exists()  # HEAD only
    for missing in (gone, str(tmp_path / "nope.safetensors")):
        bad = spec.model_copy(update={"loras": (LoRASpec(path=missing, strength=0.5),)})
        with pytest.raises(StorageError, match=f"^LoRA file {missing} does not exist$"):
            check_named_files(bad, s3=s3_server.s3_options())
