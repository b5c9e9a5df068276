"""load_dit on files it must refuse: every failure is a CheckpointError naming the file and the problem."""

from __future__ import annotations

import random
import re
import struct

import pytest
import torch
from safetensors.torch import save_file

from snapref_ray.models.dit import load_dit
from snapref_ray.models.safetensors_header import CheckpointError
from snapref_ray.models.tiny_dit import make_tiny_dit_state_dict


@pytest.fixture(scope="module")
def sd() -> dict[str, torch.Tensor]:
    return make_tiny_dit_state_dict(t5_vocab=64)


def write(path, sd: dict[str, torch.Tensor]):
    save_file({"net." + k: v for k, v in sd.items()}, str(path))
    return path


def test_truncated_file(tmp_path, sd):
    path = write(tmp_path / "dit.safetensors", sd)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: file is truncated: tensor '.+' ends at byte"):
        load_dit(path)


def test_pickle_checkpoint_is_refused_without_unpickling(tmp_path, sd):
    path = tmp_path / "dit.safetensors"  # a torch.save file under a safetensors name
    torch.save(sd, path)
    with pytest.raises(
        CheckpointError,
        match=rf"^{re.escape(str(path))}: not a safetensors file \(header length \d+"
        r" does not fit a \d+-byte file; a pickle",
    ):
        load_dit(path)


def test_random_bytes(tmp_path):
    path = tmp_path / "noise.safetensors"
    path.write_bytes(random.Random(0).randbytes(4096))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: not a safetensors file"):
        load_dit(path)


def test_header_that_is_not_json(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 8) + b"\x00garbage" + bytes(16))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: not a safetensors file \(header is not JSON"):
        load_dit(path)


def test_empty_and_absent_files(tmp_path):
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty\.safetensors: not a safetensors file \(0 bytes"):
        load_dit(empty)
    with pytest.raises(CheckpointError, match=r"absent\.safetensors: no such file"):
        load_dit(tmp_path / "absent.safetensors")


def test_missing_tensor(tmp_path, sd):
    broken = {k: v for k, v in sd.items() if k != "blocks.1.mlp.layer2.weight"}
    path = write(tmp_path / "dit.safetensors", broken)
    with pytest.raises(CheckpointError) as err:
        load_dit(path)
    assert str(err.value) == f"{path}: missing tensor 'blocks.1.mlp.layer2.weight' (expected shape [64, 256])"


def test_wrong_shape(tmp_path, sd):
    broken = {**sd, "blocks.1.self_attn.k_proj.weight": torch.zeros(64, 32)}
    path = write(tmp_path / "dit.safetensors", broken)
    with pytest.raises(CheckpointError) as err:
        load_dit(path)
    assert str(err.value) == (
        f"{path}: tensor 'blocks.1.self_attn.k_proj.weight' has shape [64, 32], expected [64, 64]"
    )


def test_missing_tensor_needed_for_the_config(tmp_path, sd):
    broken = {k: v for k, v in sd.items() if not k.startswith("x_embedder.")}
    path = write(tmp_path / "dit.safetensors", broken)
    with pytest.raises(CheckpointError) as err:
        load_dit(path)
    assert str(err.value) == (
        f"{path}: missing tensor 'x_embedder.proj.1.weight', needed to infer the model's"
        " shape (is this an Anima DiT file?)"
    )


def test_file_without_llm_adapter(tmp_path, sd):
    path = write(tmp_path / "dit.safetensors", {k: v for k, v in sd.items() if not k.startswith("llm_adapter.")})
    with pytest.raises(CheckpointError, match=r": missing tensor 'llm_adapter\.embed\.weight'"):
        load_dit(path)


def test_a_missing_block_in_the_middle_is_reported(tmp_path):
    sd = make_tiny_dit_state_dict(num_blocks=3, t5_vocab=64)
    path = write(tmp_path / "dit.safetensors", {k: v for k, v in sd.items() if not k.startswith("blocks.1.")})
    with pytest.raises(CheckpointError, match=r"missing tensor 'blocks\.1\.self_attn\.q_proj\.weight'.*; and 15 more"):
        load_dit(path)


def test_state_dict_source_is_named(sd):
    with pytest.raises(CheckpointError, match=r"^state dict: missing tensor 'blocks\.0\.mlp\.layer1\.weight'"):
        load_dit({k: v for k, v in sd.items() if k != "blocks.0.mlp.layer1.weight"})
