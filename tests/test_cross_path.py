"""One render, four front doors: `snapref-ray txt2img`, a batch job, the README's Ray Data pipeline and the
HTTP endpoint draw the same pixels for the same (reference, prompt, seed, settings, model) and record the
same facts about it.

Every path renders through the one render service (snapref_ray/service/) on the CPU with one torch thread
(a job worker and a Ray Data actor get one CPU from Ray, the endpoint's replica `cpus_per_replica: 1`,
txt2img is run here with one thread), so the images are bitwise equal. The settings every output records
(the PNG `parameters` and `snapref` chunks, the Parquet row, the endpoint's JSON `settings`) are the
settings as rendered: the adapter kind's defaults filled in. The job and Ray Data give the row the same
item id. Run for a SnapRef file and an ArcAnima v2 file, each with a plain LoRA merged (`--lora` on the
command line and the server, `loras:` in the job spec, the constructor's `model` in Ray Data).
"""

from __future__ import annotations

import base64
import csv
import io
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from snapref_ray.adapter.controls import resolve_settings
from snapref_ray.client import SnapRefClient
from snapref_ray.model_spec import LoRASpec, ModelSpec
from snapref_ray.requests import RenderSettings
from snapref_ray.storage.image_files import read_image_info, read_image_parameters
from snapref_ray.tiny import TinyConfig, write_tiny_adapter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = "1girl, solo, beach, summer"
SEED = 3
SETTINGS = {"width": 256, "height": 256, "steps": 2, "sampler": "euler"}
LORA_STRENGTH = 0.8


@pytest.fixture(scope="module")
def server(local_serve):
    """The session's local Serve (tests/conftest.py), which each case deploys its own app on; the job and the
    Ray Data pipeline run on its Ray too. (config, the LocalServe)."""
    from snapref_ray.serve.config import ServeConfig

    return ServeConfig(model="unused", port=local_serve.port, cpus_per_replica=1.0, max_replicas=1), local_serve


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


@pytest.fixture(scope="module", params=["snapref", "arcanima-v2"])
def case(request, tiny_models: Path, tmp_path_factory):
    """(adapter kind, ModelSpec with a LoRA, the reference path, a folder for this case)."""
    from snapref_ray.tiny import write_tiny_lora

    kind = request.param
    folder = tmp_path_factory.mktemp(f"cross-{kind}")
    adapter = (
        tiny_models / "adapter.safetensors"
        if kind == "snapref"
        else write_tiny_adapter(folder / "v2.safetensors", TinyConfig(), kind)
    )
    lora = write_tiny_lora(folder / "style.safetensors")
    model = ModelSpec(
        models_dir=str(tiny_models),
        adapter=str(adapter),
        loras=[LoRASpec(path=str(lora), strength=LORA_STRENGTH)],
        device="cpu",
    )
    return kind, model, tiny_models / "reference.png", folder


def _txt2img(model: ModelSpec, reference: Path, out: Path, *, with_lora: bool = True) -> bytes:
    from snapref_ray import cli

    flags = ["--models", model.models_dir, "--adapter", model.adapter, "--device", "cpu"]
    if with_lora:
        flags += ["--lora", f"{model.loras[0].path}:{LORA_STRENGTH}"]
    settings = [f"--{k}={v}" for k, v in SETTINGS.items()]
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as a job worker, a Ray Data actor and a one-CPU replica run
    try:
        code = cli.main(
            [
                "txt2img",
                *flags,
                "--reference",
                str(reference),
                "--prompt",
                PROMPT,
                "--seed",
                str(SEED),
                *settings,
                "--out",
                str(out),
            ]
        )
    finally:
        torch.set_num_threads(before)
    assert code == 0
    return out.read_bytes()


def _job(model: ModelSpec, reference: Path, folder: Path) -> tuple[bytes, dict]:
    from snapref_ray.pipelines.generate_dataset import run_job
    from snapref_ray.storage.jobspec import JobSpec

    manifest = folder / "manifest.csv"
    with manifest.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["reference", "prompt", "seed"])
        writer.writeheader()
        writer.writerow({"reference": str(reference), "prompt": PROMPT, "seed": SEED})
    spec = JobSpec.model_validate(
        {
            "model": model.model_dump(),
            "manifest": str(manifest),
            "defaults": SETTINGS,
            "output": {"uri": str(folder / "job")},
            "cluster": {"num_workers": 1},
        }
    )
    summary = run_job(spec, progress=False, write_gallery=False)
    assert summary["images_this_run"] == 1 and summary["failed_items"] == 0
    (row,) = pq.read_table(folder / "job" / "metadata").to_pylist()
    return (folder / "job" / row["image_key"]).read_bytes(), row


def _ray_data(model: ModelSpec, reference: Path) -> dict:
    import ray

    from snapref_ray.data import SnapRefRenderer

    rows = (
        ray.data.from_items([{"reference": str(reference), "prompt": PROMPT, "seed": SEED}])
        .map_batches(
            SnapRefRenderer,
            fn_constructor_kwargs={"model": model.model_dump(), "defaults": SETTINGS},
            compute=ray.data.ActorPoolStrategy(size=1),
            num_cpus=1,
            batch_size=1,
            udf_modifying_row_count=False,
        )
        .take_all()
    )
    (row,) = rows
    assert row["error"] is None, row["error"]
    return row


def _endpoint(server, model: ModelSpec, reference: Path) -> dict:
    config, local_serve = server
    with local_serve.deployed(config.model_copy(update={"model": model})) as url:
        client = SnapRefClient(url, timeout=300, retries=0)
        reference_id = client.upload_reference(reference.read_bytes())
        return client.render(PROMPT, reference_id=reference_id, seed=SEED, response_format="json", **SETTINGS)


def test_txt2img_job_ray_data_and_the_endpoint_agree(case, server):
    kind, model, reference, folder = case
    expected = resolve_settings(RenderSettings(**SETTINGS), kind).model_dump(mode="json")

    cli_png = _txt2img(model, reference, folder / "txt2img.png")
    job_png, job_row = _job(model, reference, folder)
    data_row = _ray_data(model, reference)
    answer = _endpoint(server, model, reference)
    served_png = base64.b64decode(answer["images"][0]["png_base64"])

    # The same pixels, bitwise.
    images = {"txt2img": cli_png, "job": job_png, "ray data": data_row["image"], "endpoint": served_png}
    reference_pixels = _pixels(cli_png)
    for path, png in images.items():
        assert np.array_equal(_pixels(png), reference_pixels), f"{path} drew other pixels than txt2img ({kind})"
    # The LoRA was merged on every path (else all four could agree on the plain model's image).
    plain = _pixels(_txt2img(model, reference, folder / "plain.png", with_lora=False))
    assert not np.array_equal(plain, reference_pixels)

    # The same item id in the job and in Ray Data; the same settings, as rendered, in every output.
    assert job_row["item_id"] == data_row["item_id"]
    assert json.loads(job_row["settings_json"]) == json.loads(data_row["settings_json"]) == expected
    assert answer["settings"] == expected
    parameters = {path: read_image_parameters(png).splitlines()[-1] for path, png in images.items()}
    assert len(set(parameters.values())) == 1, parameters
    for path, png in images.items():
        info = read_image_info(png)
        assert info["settings"] == expected, path
        assert (info["prompt"], info["seed"]) == (PROMPT, SEED)
        assert info["reference_hash"] == job_row["reference_hash"], path
        assert info["model"] == job_row["model"] and info["adapter"] == job_row["adapter"], path
    assert read_image_info(job_png)["item_id"] == read_image_info(data_row["image"])["item_id"] == job_row["item_id"]
