"""The real-size DiT, built on the meta device, has exactly the released file's keys, shapes and size."""

from __future__ import annotations

import torch

from snapref_ray.models.dit import AnimaDiT
from snapref_ray.models.dit_config import DiTConfig, real_dit_config


def meta_model(num_blocks: int) -> AnimaDiT:
    with torch.device("meta"):
        return AnimaDiT(real_dit_config(num_blocks))


def test_keys_and_shapes_equal_the_comfyui_dump(ref_keys_dir):
    expected = (ref_keys_dir / "keys-anima-dit-comfyui.txt").read_text().splitlines()
    ours = [f"{key}\t{list(p.shape)}" for key, p in meta_model(28).named_parameters()]
    assert len(expected) == 685
    assert ours == expected  # same keys, shapes and order
    assert not list(meta_model(28).buffers())  # nothing persistent beyond the file's tensors


def test_parameter_counts():
    base = meta_model(28)
    assert sum(p.numel() for p in base.parameters()) == 2_091_068_928
    assert sum(p.numel() for p in base.blocks.parameters()) == 1_937_782_784
    assert sum(p.numel() for p in base.llm_adapter.parameters()) == 134_663_680
    assert sum(p.numel() for p in meta_model(40).parameters()) == 2_921_547_264


def test_config_inferred_from_real_shapes(ref_keys_dir):
    lines = (ref_keys_dir / "keys-anima-dit-comfyui.txt").read_text().splitlines()
    sd = {}
    for line in lines:
        key, shape = line.split("\t")
        sd[key] = torch.empty([int(n) for n in shape.strip("[]").split(", ")], device="meta")
    assert DiTConfig.from_state_dict(sd) == real_dit_config(28)
    # Anima-2.9B: 12 more blocks with the same shapes
    sd.update(
        {
            k.replace("blocks.0.", f"blocks.{n}.", 1): v
            for k, v in sd.items()
            if k.startswith("blocks.0.")
            for n in range(28, 40)
        }
    )
    assert DiTConfig.from_state_dict(sd) == real_dit_config(40)
