from pathlib import Path

import pytest

from snapref_ray.models.bundle import ModelFilesError, resolve_model_files


def touch(root: Path, *names: str) -> None:
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith("/"):
            path.mkdir(exist_ok=True)
        else:
            path.write_bytes(b"")


def test_tiny_names(tmp_path):
    touch(
        tmp_path,
        "dit.safetensors",
        "text_encoder.safetensors",
        "vae.safetensors",
        "adapter.safetensors",
        "tokenizers/qwen/",
        "tokenizers/t5/",
    )
    files = resolve_model_files(tmp_path)
    assert files.dit.name == "dit.safetensors" and files.adapter.name == "adapter.safetensors"
    assert files.qwen_tokenizer == tmp_path / "tokenizers" / "qwen"


def test_comfyui_folder_layout_and_an_adapter_is_never_taken_for_the_dit(tmp_path):
    touch(
        tmp_path,
        "diffusion_models/anima-base-v1.0.safetensors",
        "text_encoders/qwen_3_06b_base.safetensors",
        "vae/qwen_image_vae.safetensors",
        "snapref_anima_ref_kv_v1.safetensors",
        "qwen/",
        "t5/",
    )
    files = resolve_model_files(tmp_path)
    assert files.dit.name == "anima-base-v1.0.safetensors"
    assert files.text_encoder.parent.name == "text_encoders" and files.vae.parent.name == "vae"
    assert files.adapter.name == "snapref_anima_ref_kv_v1.safetensors"


def test_missing_parts_are_named(tmp_path):
    touch(tmp_path, "dit.safetensors")
    with pytest.raises(ModelFilesError, match="lacks text_encoder, vae, qwen_tokenizer, t5_tokenizer"):
        resolve_model_files(tmp_path)
    with pytest.raises(ModelFilesError, match="make-tiny"):
        resolve_model_files(tmp_path / "nope")
