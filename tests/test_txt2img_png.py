"""`snapref-ray txt2img` writes its files with the project's one image writer (parameters + snapref chunks)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from snapref_ray.adapter.images import content_hash
from snapref_ray.cli import main
from snapref_ray.storage.image_files import read_image_info, read_image_parameters


@pytest.mark.slow
def test_txt2img_png_carries_parameters_and_the_reference_hash(tiny_models, tiny_renderer, tmp_path):
    from snapref_ray.requests import RenderRequest, RenderSettings

    reference = tiny_models / "reference.png"
    out = tmp_path / "scene.png"
    code = main(
        [
            "txt2img",
            "--models",
            str(tiny_models),
            "--prompt",
            "1girl, cafe",
            "--out",
            str(out),
            "--seed",
            "5",
            "--reference",
            str(reference),
            "--device",
            "cpu",
            "--width",
            "256",
            "--height",
            "256",
            "--steps",
            "2",
            "--cfg",
            "1",
            "--sampler",
            "euler",
        ]
    )

    assert code == 0
    data = out.read_bytes()
    info = read_image_info(data)
    # The settings the image was drawn with, SnapRef's published defaults filled in (as every front door records)
    settings = RenderSettings(
        width=256,
        height=256,
        steps=2,
        cfg=1.0,
        sampler="euler",
        ref_guidance=1.0,
        ref_in_uncond=False,
        ref_outside="reference",
        strength=1.0,
    )
    assert info["seed"] == 5 and info["prompt"] == "1girl, cafe"
    assert info["settings"] == settings.model_dump()
    assert info["reference_hash"] == content_hash(reference.read_bytes())
    assert info["adapter"] == tiny_renderer.adapter.identity
    assert "Seed: 5, Size: 256x256" in read_image_parameters(data)
    # The pixels are the engine's render of the same request (the file is lossless).
    (expected,) = tiny_renderer.render(
        RenderRequest(prompt="1girl, cafe", seed=5, settings=settings), references=[reference.read_bytes()]
    )
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), np.asarray(expected.image))
