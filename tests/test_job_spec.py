"""Job specs: YAML loading, errors naming file and field, path resolution, quick form, fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from snapref_ray.job_spec import JobSpec, JobSpecError, load_job_spec, quick_spec, spec_fingerprint
from snapref_ray.model_spec import ModelSpec
from snapref_ray.models.bundle import ModelFilesError
from snapref_ray.requests import RenderSettings, RowDefaults
from snapref_ray.storage.backends import S3Options

REPO = Path(__file__).resolve().parents[1]


def write_spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def make_models_dir(root: Path, names: tuple[str, ...]) -> Path:
    """Empty stand-ins for model files: the folder convention looks at names only."""
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith("/"):
            path.mkdir(exist_ok=True)
            (path / "tokenizer_config.json").write_text("{}")
        else:
            path.write_bytes(b"")
    return root


TINY_NAMES = (
    "dit.safetensors",
    "text_encoder.safetensors",
    "vae.safetensors",
    "adapter.safetensors",
    "tokenizers/qwen/",
    "tokenizers/t5/",
)


def test_example_spec_loads_with_paths_beside_it():
    spec = load_job_spec(str(REPO / "snapref_ray" / "examples" / "example_spec.yaml"))
    assert spec.manifest == str(REPO / "snapref_ray" / "examples" / "example_manifest.csv")
    assert spec.model.models_dir == str(REPO / "tiny")
    assert spec.output.uri == str(REPO / "out" / "example")
    assert (spec.defaults.width, spec.defaults.height, spec.defaults.steps, spec.defaults.sampler) == (
        256,
        256,
        4,
        "euler",
    )
    assert spec.cluster.cpu_workers == 2 and spec.strict is False


def test_minimal_spec_takes_the_documented_defaults(tmp_path):
    spec = load_job_spec(str(write_spec(tmp_path, "model: {models_dir: models}\nmanifest: m.csv\n")))
    assert spec.model.models_dir == str(tmp_path / "models")
    assert spec.manifest == str(tmp_path / "m.csv")
    assert spec.output.uri == "./output"  # not written in the file: relative to the current directory
    assert spec.defaults.settings() == RenderSettings()
    assert (spec.defaults.seed, spec.defaults.images_per_prompt) == (0, 1)
    assert spec.cluster.model_dump() == {
        "address": None,
        "num_workers": None,
        "min_workers": 1,
        "max_workers": None,
        "cpu_workers": 2,
        "num_cpus_per_worker": 1.0,
        "refkv_cache_bytes": 8 * 2**30,
        "max_in_flight_per_worker": 2,
        "max_attempts": 3,
        "max_requeues_per_item": 10,
        "refkv_fetch_timeout_s": 30.0,
        "max_batch": 4,
        "transfer_gbps": None,
        "start_timeout_s": 900.0,
        "memory_per_worker": None,
        "output_threads": 4,
    }
    assert spec.model.model_dump(exclude={"models_dir"}) == {
        **dict.fromkeys(("dit", "text_encoder", "vae", "qwen_tokenizer", "t5_tokenizer", "adapter")),
        "loras": (),
        "device": "auto",
        "dtype": "auto",
        "compile": False,
        "compile_cache": None,
        "quantize": "none",
    }
    assert spec.output.model_dump() == {
        "uri": "./output",
        "image_format": "png",
        "embed_images": False,
        "append": False,
        "rerender_changed": False,
        "s3": {"endpoint_url": None, "region": None, "retry_mode": "adaptive", "max_attempts": 10},
        "metadata_flush_seconds": 30.0,
        "format": "files",
        "shard_max_bytes": 1_000_000_000,
        "shard_max_items": 10_000,
        "thumbnail_every": 1000,
        "lease_seconds": 60.0,
        "lease_wait_seconds": 0.0,
    }
    assert (spec.strict, spec.allow_empty_prompt) == (False, False)


def test_typos_and_bad_values_name_the_file_and_field_path(tmp_path):
    path = write_spec(
        tmp_path,
        """
model: {models_dir: m, loras: [{path: a.safetensors, strenght: 0.5}]}
manifest: m.csv
defaults: {sampeler: euler, width: 100000}
cluster: {num_worker: 2}
outptu: {}
""",
    )
    with pytest.raises(JobSpecError) as info:
        load_job_spec(str(path))
    assert str(info.value) == (
        f"invalid job spec {path}:\n"
        "  model.loras[0].strenght: unknown field (did you mean 'strength'?)\n"
        "  defaults.width: width must be a multiple of 16 between 256 and 4096, got 100000\n"
        "  defaults.sampeler: unknown field (did you mean 'sampler'?)\n"
        "  cluster.num_worker: unknown field (did you mean 'num_workers'?)\n"
        "  outptu: unknown field (did you mean 'output'?)"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("manifest: m.csv\n", "invalid job spec {path}:\n  model: Field required"),
        (
            "model: {}\nmanifest: m.csv\n",
            "invalid job spec {path}:\n  model: give models_dir, or every model file; "
            "missing: dit, text_encoder, vae, qwen_tokenizer, t5_tokenizer",
        ),
        (
            "models: {models_dir: m}\nadapter: a.safetensors\nmanifest: m.csv\ncluster: {dtype: float32}\n",
            "invalid job spec {path}:\n  (top level): these fields moved into the `model:` section: models ->"
            " model.models_dir (or model.dit, model.vae, ...); adapter -> model.adapter; cluster.dtype -> model.dtype",
        ),
        (
            "model: {models_dir: m}\nmanifest: m.csv\ndefaults: {sampler: dpmpp}\n",
            "invalid job spec {path}:\n  defaults.sampler: Input should be 'euler' or 'er_sde'",
        ),
        (
            "model: m\nmanifest: m.csv\noutput: {image_format: gif}\n",
            "invalid job spec {path}:\n  output.image_format: Input should be 'png', 'webp' or 'jpeg'",
        ),
        ("- a\n- b\n", "{path}: expected a mapping of spec fields at the top, found list"),
        ("model: [\n", "{path}: not valid YAML"),
    ],
)
def test_spec_errors(tmp_path, text, message):
    path = write_spec(tmp_path, text)
    with pytest.raises(JobSpecError) as info:
        load_job_spec(str(path))
    assert str(info.value).startswith(message.format(path=path))


def test_missing_spec_file(tmp_path):
    with pytest.raises(JobSpecError, match=r"^job spec .*absent\.yaml not found$"):
        load_job_spec(str(tmp_path / "absent.yaml"))


def test_relative_paths_resolve_against_the_spec_folder(tmp_path):
    path = write_spec(
        tmp_path,
        """
model: {dit: m/dit.safetensors, text_encoder: /abs/te.safetensors, vae: s3://b/vae.safetensors,
        qwen_tokenizer: tok/qwen, t5_tokenizer: tok/t5, adapter: ../adapters/a.safetensors,
        loras: [{path: loras/l.safetensors}]}
manifest: data/m.parquet
output: {uri: out}
""",
    )
    spec = load_job_spec(str(path))
    assert spec.model.dit == str(tmp_path / "m" / "dit.safetensors")
    assert spec.model.text_encoder == "/abs/te.safetensors"
    assert spec.model.vae == "s3://b/vae.safetensors"
    assert spec.model.adapter == str(tmp_path.parent / "adapters" / "a.safetensors")
    lora = spec.model.loras[0]
    assert lora.path == str(tmp_path / "loras" / "l.safetensors") and lora.strength == 1.0
    assert spec.manifest == str(tmp_path / "data" / "m.parquet")
    assert spec.output.uri == str(tmp_path / "out")


def test_row_defaults_are_the_request_model_plus_seed_and_count():
    assert set(RowDefaults.model_fields) == set(RenderSettings.model_fields) | {"seed", "images_per_prompt"}
    defaults = RowDefaults(steps=12, seed=7, images_per_prompt=3, ref_end=0.6)
    assert defaults.settings() == RenderSettings(steps=12, ref_end=0.6)
    with pytest.raises(ValueError, match="ref_start"):
        RowDefaults(ref_start=0.8, ref_end=0.5)  # the request model's own rules apply to defaults


def test_every_spec_field_says_why():
    def walk(model: type[BaseModel]):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            for sub in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(sub, type) and issubclass(sub, BaseModel) and sub is not model:
                    walk(sub)

    walk(JobSpec)


def test_quick_spec_routes_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = quick_spec(
        "refs/m.csv",
        "s3://bucket/out",
        model=ModelSpec(models_dir="models", adapter="a.safetensors"),
        workers=3,
        steps=8,
        seed=5,
        strict=True,
        max_batch=2,
        image_format="webp",
    )
    assert spec.manifest == str(tmp_path / "refs" / "m.csv")
    assert spec.model.models_dir == str(tmp_path / "models")
    assert spec.model.adapter == str(tmp_path / "a.safetensors")
    assert spec.output.uri == "s3://bucket/out" and spec.output.image_format == "webp"
    assert (spec.cluster.num_workers, spec.cluster.max_batch) == (3, 2)
    assert (spec.defaults.steps, spec.defaults.seed, spec.strict) == (8, 5, True)
    assert quick_spec("m.csv", "out", model=ModelSpec(models_dir="models")).output.uri == str(tmp_path / "out")

    with pytest.raises(JobSpecError, match=r"^quick_spec: unknown setting 'stepz'$"):
        quick_spec("m.csv", "out", model=ModelSpec(models_dir="models"), stepz=3)
    with pytest.raises(JobSpecError, match=r"defaults.steps: Input should be greater than or equal to 1"):
        quick_spec("m.csv", "out", model=ModelSpec(models_dir="models"), steps=0)


def base_spec(**changes) -> JobSpec:
    model = {"models_dir": "/m", "adapter": "/a.safetensors", **changes.pop("model", {})}
    return JobSpec.model_validate({"model": model, "manifest": "/m.csv", **changes})


def test_fingerprint_holds_what_determines_the_images():
    fingerprint = spec_fingerprint(base_spec())
    json.dumps(fingerprint)  # storable as it is
    assert fingerprint["defaults"]["steps"] == 30 and fingerprint["manifest"] == "/m.csv"
    # Where and how fast it runs is not part of the job's identity ...
    same = [
        base_spec(cluster={"num_workers": 16, "address": "auto"}),
        base_spec(output={"uri": "s3://b/o"}),
        base_spec(strict=True),
        base_spec(model={"device": "cuda:1", "compile": True}),
    ]
    assert all(spec_fingerprint(spec) == fingerprint for spec in same)
    # ... what the images are made of is.
    different = [
        base_spec(defaults={"steps": 31}),
        base_spec(model={"adapter": "/b.safetensors"}),
        base_spec(model={"loras": [{"path": "/l.safetensors", "strength": 0.5}]}),
        base_spec(manifest="/n.csv"),
        base_spec(model={"models_dir": "/other"}),
        base_spec(output={"image_format": "webp"}),
        base_spec(model={"dtype": "float32"}),
        base_spec(model={"quantize": "fp8"}),
    ]
    assert all(spec_fingerprint(spec) != fingerprint for spec in different)


def test_model_spec_files_from_a_tiny_folder(tmp_path):
    models = make_models_dir(tmp_path / "tiny", TINY_NAMES)
    files = ModelSpec(models_dir=str(models)).local_files()
    assert (files.dit, files.text_encoder, files.vae, files.adapter) == (
        models / "dit.safetensors",
        models / "text_encoder.safetensors",
        models / "vae.safetensors",
        models / "adapter.safetensors",
    )
    assert (files.qwen_tokenizer, files.t5_tokenizer) == (models / "tokenizers" / "qwen", models / "tokenizers" / "t5")
    # An explicit file and the spec's adapter win over the folder's.
    spec = ModelSpec(models_dir=str(models), vae="/x/vae.safetensors", adapter="/y/a.safetensors")
    assert (spec.local_files().vae, spec.local_files().adapter) == (
        Path("/x/vae.safetensors"),
        Path("/y/a.safetensors"),
    )


def test_model_spec_files_from_comfyui_names(tmp_path):
    models = make_models_dir(
        tmp_path / "comfy",
        (
            "anima-base-v1.0.safetensors",
            "qwen_3_06b_base.safetensors",
            "qwen_image_vae.safetensors",
            "tokenizers/qwen/",
            "tokenizers/t5/",
        ),
    )
    files = ModelSpec(models_dir=str(models), adapter="/a.safetensors").local_files()
    assert (files.dit.name, files.text_encoder.name, files.vae.name) == (
        "anima-base-v1.0.safetensors",
        "qwen_3_06b_base.safetensors",
        "qwen_image_vae.safetensors",
    )
    assert files.adapter == Path("/a.safetensors")


def test_model_spec_files_errors(tmp_path):
    models = make_models_dir(tmp_path / "noadapter", TINY_NAMES[:3] + TINY_NAMES[4:])
    assert ModelSpec(models_dir=str(models)).local_files().adapter is None  # a plain model: no reference adapter
    with pytest.raises(ModelFilesError, match="lacks vae"):
        ModelSpec(models_dir=str(make_models_dir(tmp_path / "novae", TINY_NAMES[:2]))).local_files()
    remote = ModelSpec(models_dir="s3://bucket/models")
    assert remote.is_remote() and not ModelSpec(models_dir="/m").is_remote()
    assert ModelSpec(models_dir="/m", loras=[{"path": "s3://b/l.safetensors"}]).is_remote()
    with pytest.raises(ModelFilesError, match=r"models_dir s3://bucket/models is remote"):
        remote.local_files()
    # A node-local copy of the remote folder stands in for it.
    local_copy = make_models_dir(tmp_path / "copy", TINY_NAMES)
    assert remote.local_files(models_dir=local_copy).dit == local_copy / "dit.safetensors"


def test_s3_options_come_from_the_output_section():
    spec = base_spec(
        output={
            "s3": {
                "endpoint_url": "http://127.0.0.1:9000",
                "region": "eu-west-1",
                "retry_mode": "standard",
                "max_attempts": 4,
            }
        }
    )
    assert spec.s3_options() == S3Options(
        endpoint_url="http://127.0.0.1:9000", region="eu-west-1", retry_mode="standard", max_attempts=4
    )
    assert "access_key" not in type(spec.output.s3).model_fields  # credentials never live in a spec


def test_output_format_and_the_lease_settings():
    sharded = base_spec(output={"format": "webdataset", "shard_max_items": 500, "lease_wait_seconds": 120})
    assert (sharded.output.format, sharded.output.shard_max_items, sharded.output.shard_max_bytes) == (
        "webdataset",
        500,
        1_000_000_000,
    )
    # A sharded output is another job than the same spec written as files; the files fingerprint is as before.
    assert spec_fingerprint(sharded) == {**spec_fingerprint(base_spec()), "format": "webdataset"}
    assert "format" not in spec_fingerprint(base_spec(output={"lease_seconds": 30, "thumbnail_every": 7}))
    with pytest.raises(ValueError, match="embed_images needs format: files"):
        base_spec(output={"format": "webdataset", "embed_images": True})
    with pytest.raises(ValueError, match="rerender_changed needs format: files"):
        base_spec(output={"format": "webdataset", "rerender_changed": True})
    with pytest.raises(ValueError, match="output.format"):
        base_spec(output={"format": "tfrecord"})
    with pytest.raises(ValueError, match="lease_seconds"):
        base_spec(output={"lease_seconds": 1})
