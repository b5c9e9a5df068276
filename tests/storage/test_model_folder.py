"""A models folder on s3:// is mirrored on the node with its layout, so the loaders find their files."""

from __future__ import annotations

import uuid

import pytest

from snapref_ray.models.bundle import resolve_model_files
from snapref_ray.storage.backends import StorageError
from snapref_ray.storage.model_cache import ensure_local_folder


def test_local_folder_passes_through(tmp_path):
    assert ensure_local_folder(str(tmp_path)) == tmp_path
    with pytest.raises(StorageError, match="does not exist"):
        ensure_local_folder(str(tmp_path / "nope"))


def test_s3_models_folder_is_mirrored_once_with_its_layout(s3_server, tiny_models, tmp_path):
    prefix = f"models/{uuid.uuid4().hex[:8]}"
    client = s3_server.client()
    files = sorted(p for p in tiny_models.rglob("*") if p.is_file())
    for path in files:
        client.put_object(
            Bucket=s3_server.bucket, Key=f"{prefix}/{path.relative_to(tiny_models)}", Body=path.read_bytes()
        )
    uri = f"s3://{s3_server.bucket}/{prefix}"
    folder = ensure_local_folder(uri, tmp_path / "cache", s3_server.s3_options())
    for path in files:
        assert (folder / path.relative_to(tiny_models)).read_bytes() == path.read_bytes()
    again = ensure_local_folder(uri + "/", tmp_path / "cache", s3_server.s3_options())
    assert again == folder
    found = resolve_model_files(folder)
    assert found.dit.name == "dit.safetensors" and found.adapter.name == "adapter.safetensors"


def test_bucket_root_and_empty_prefix_are_clear_errors(s3_server, tmp_path):
    with pytest.raises(StorageError, match="give a prefix"):
        ensure_local_folder(f"s3://{s3_server.bucket}", tmp_path, s3_server.s3_options())
    with pytest.raises(StorageError, match="empty or does not exist"):
        ensure_local_folder(
            f"s3://{s3_server.bucket}/nothing-here-{uuid.uuid4().hex}", tmp_path, s3_server.s3_options()
        )
