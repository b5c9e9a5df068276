"""ModelSpec and LoRASpec: the one model description every front door embeds (job spec, serve config,
Ray Data, the CLI). The command-line form of a LoRA, the folder shorthand, path resolution and which
fields count towards a job's fingerprint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from snapref_ray.model_spec import LoRASpec, ModelSpec
from snapref_ray.models.bundle import ModelFilesError

REPO = Path(__file__).resolve().parents[1]


def test_lora_parse_reads_an_optional_trailing_strength(tmp_path):
    assert LoRASpec.parse("style.safetensors") == LoRASpec(path="style.safetensors", strength=1.0)
    assert LoRASpec.parse("style.safetensors:0.6") == LoRASpec(path="style.safetensors", strength=0.6)
    assert LoRASpec.parse("s3://bucket/lora.safetensors:-1.5") == LoRASpec(
        path="s3://bucket/lora.safetensors", strength=-1.5
    )
    # a colon that is not followed by a number belongs to the path
    assert LoRASpec.parse("s3://bucket/lora.safetensors").path == "s3://bucket/lora.safetensors"
    # a file whose own name ends in ":<number>" is taken whole
    odd = tmp_path / "v1:2"
    odd.write_bytes(b"")
    assert LoRASpec.parse(str(odd)) == LoRASpec(path=str(odd))
    with pytest.raises(ValidationError, match="strength"):
        LoRASpec.parse("style.safetensors:50")


def test_a_string_is_a_models_folder_and_a_folder_or_every_file_is_required():
    assert ModelSpec.model_validate("/models") == ModelSpec(models_dir="/models")
    with pytest.raises(ValidationError, match="missing: dit, text_encoder, vae, qwen_tokenizer, t5_tokenizer"):
        ModelSpec()
    with pytest.raises(ValidationError, match="missing: qwen_tokenizer, t5_tokenizer"):
        ModelSpec(dit="d", text_encoder="t", vae="v")
    with pytest.raises(ValidationError, match="extra"):
        ModelSpec.model_validate({"models_dir": "/m", "adapters": "typo"})


def test_relative_paths_resolve_against_the_spec_files_folder_and_remote_ones_stay():
    spec = ModelSpec(
        models_dir="models",
        adapter="/abs/adapter.safetensors",
        vae="s3://bucket/vae.safetensors",
        loras=(LoRASpec(path="loras/style.safetensors", strength=0.5),),
    )
    local = spec.resolve_paths("/jobs/run1")
    assert (local.models_dir, local.adapter, local.vae) == (
        "/jobs/run1/models",
        "/abs/adapter.safetensors",
        "s3://bucket/vae.safetensors",
    )
    assert local.loras == (LoRASpec(path="/jobs/run1/loras/style.safetensors", strength=0.5),)
    remote = spec.resolve_paths("s3://bucket/jobs")
    assert remote.models_dir == "s3://bucket/jobs/models" and remote.is_remote()
    assert not ModelSpec(models_dir="/m").is_remote()
    assert ModelSpec(models_dir="/m", loras=(LoRASpec(path="s3://b/l.safetensors"),)).is_remote()


def test_local_files_take_explicit_files_over_the_folder(tiny_models, tmp_path):
    files = ModelSpec(models_dir=str(tiny_models)).local_files()
    assert files.dit.parent == tiny_models and files.adapter == tiny_models / "adapter.safetensors"
    other_vae = tmp_path / "other-vae.safetensors"
    chosen = ModelSpec(models_dir=str(tiny_models), vae=str(other_vae), adapter="/x/a.safetensors").local_files()
    assert (chosen.vae, str(chosen.adapter), chosen.dit) == (other_vae, "/x/a.safetensors", files.dit)
    with pytest.raises(ModelFilesError, match=r"vae=s3://b/vae\.safetensors"):
        ModelSpec(models_dir=str(tiny_models), vae="s3://b/vae.safetensors").local_files()
    with pytest.raises(ModelFilesError, match="is remote"):
        ModelSpec(models_dir="s3://b/models").local_files()


def test_fingerprint_changes_with_what_changes_pixels_only():
    base = ModelSpec(models_dir="/m")
    same = [base.model_copy(update={"device": "cuda:1"}), base.model_copy(update={"compile": True})]
    assert all(s.fingerprint() == base.fingerprint() for s in same)
    different = [
        base.model_copy(update={"dtype": "bfloat16"}),
        base.model_copy(update={"quantize": "fp8"}),
        base.model_copy(update={"adapter": "/m/other.safetensors"}),
        base.model_copy(update={"loras": (LoRASpec(path="/l.safetensors", strength=0.7),)}),
        base.model_copy(update={"loras": (LoRASpec(path="/l.safetensors", strength=0.8),)}),
    ]
    prints = [base.fingerprint(), *(d.fingerprint() for d in different)]
    assert len({repr(p) for p in prints}) == len(prints)


def test_a_model_spec_and_the_serve_reference_store_load_without_torch():
    """Describing a model, and Serve's ReferenceStore replica (which only keeps reference bytes), import no
    torch: `snapref_ray.models` imports its network modules on first use, not with the package. A fresh
    interpreter, since this one imported torch long ago."""
    code = (
        "import sys\n"
        "from snapref_ray.model_spec import ModelSpec\n"
        "from snapref_ray.serve.reference_store import ReferenceStore\n"
        "from snapref_ray.models import bundle\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
        "from snapref_ray.models import WanVAE, load_dit\n"  # the package's names still resolve, on first use
        "assert 'torch' in sys.modules and WanVAE.__module__ == 'snapref_ray.models.vae'\n"
        "import snapref_ray.models as m\n"
        "assert sorted(m.__all__) == sorted(n for n in m.__all__ if getattr(m, n) is not None)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)
