"""The YAML job spec: models, adapter, LoRAs, row defaults, output and cluster shape.

One typed object (`JobSpec`) for a batch job, whichever way it is started: a YAML file
(`load_job_spec`) or the quick command line form (`quick_spec`). Row settings are the request
model's (`RenderSettings`) fields, so `defaults:` in a spec, a manifest column, a CLI flag and an
HTTP field all mean the same thing.

Relative local paths written in a spec file resolve against the spec file's folder (so a spec
and its manifest can travel together); defaults that the file does not set (output `./output`)
are relative to the current directory. `quick_spec` makes local paths absolute against the
current directory.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from snapref_ray.models.bundle import ModelFiles, ModelFilesError, resolve_model_files
from snapref_ray.requests import RenderSettings
from snapref_ray.storage.backends import S3Options, read_uri
from snapref_ray.storage.manifest import manifest_base, resolve_relative


class JobSpecError(ValueError):
    """A job spec that cannot be loaded: the message names the file and the field path."""


# ---------------------------------------------------------------------------------------------
# Model files: the folder convention is `snapref_ray.models.bundle.resolve_model_files` (the one
# the Renderer loads with); re-exported here so spec users need one import.


def _is_remote(path: str | None) -> bool:
    return path is not None and "://" in path


# ---------------------------------------------------------------------------------------------
# Spec sections


class _Section(BaseModel):
    # extra="forbid": a typo'd key in a spec is an error, not a silently ignored setting.
    model_config = ConfigDict(extra="forbid")


class ModelPaths(_Section):
    """The Anima model files: a models folder, or each file named (an explicit file wins)."""

    models_dir: str | None = Field(
        None,
        description="Folder (local or s3://) with the model files by the `resolve_model_files` convention; "
        "the simplest way to point at both the tiny test models and a ComfyUI models folder.",
    )
    dit: str | None = Field(None, description="DiT + LLM adapter file; overrides the one found in models_dir.")
    text_encoder: str | None = Field(None, description="Qwen3-0.6B base text encoder file; overrides models_dir's.")
    vae: str | None = Field(None, description="Qwen-Image VAE file; overrides models_dir's.")
    qwen_tokenizer: str | None = Field(
        None, description="Qwen tokenizer folder; overrides models_dir's tokenizers/qwen."
    )
    t5_tokenizer: str | None = Field(None, description="T5 tokenizer folder; overrides models_dir's tokenizers/t5.")

    @model_validator(mode="after")
    def _dir_or_files(self) -> ModelPaths:
        missing = [name for name in _EXPLICIT_MODEL_FIELDS if getattr(self, name) is None]
        if self.models_dir is None and missing:
            raise ValueError(f"give models_dir, or every model file; missing: {', '.join(missing)}")
        return self

    def is_remote(self) -> bool:
        """Whether any model path is an s3:// URI (fetched into a node-local cache before loading)."""
        return any(_is_remote(getattr(self, name)) for name in ("models_dir", *_EXPLICIT_MODEL_FIELDS))

    def resolve(self, models_dir: str | os.PathLike | None = None) -> ModelFiles:
        """The local model files: explicit ones as given, the rest from the folder convention.

        `models_dir` replaces the spec's (a node-local copy of an s3:// models_dir). Remote
        explicit files must be localised by the caller first: this raises `ModelFilesError` for
        any s3:// path it would have to return.
        """
        folder = os.fspath(models_dir) if models_dir is not None else self.models_dir
        explicit = {name: getattr(self, name) for name in _EXPLICIT_MODEL_FIELDS}
        adapter = None
        if not all(explicit.values()):
            if _is_remote(folder):
                raise ModelFilesError(f"models_dir {folder} is remote: fetch it into a local folder and pass that")
            from_dir = resolve_model_files(folder)
            adapter = from_dir.adapter
            explicit = {name: value or os.fspath(getattr(from_dir, name)) for name, value in explicit.items()}
        remote = [f"{name}={path}" for name, path in explicit.items() if _is_remote(path)]
        if remote:
            raise ModelFilesError(f"model files are remote ({', '.join(remote)}): fetch them first")
        return ModelFiles(adapter=adapter, **{name: Path(path) for name, path in explicit.items()})


_EXPLICIT_MODEL_FIELDS = ("dit", "text_encoder", "vae", "qwen_tokenizer", "t5_tokenizer")


class LoRASpec(_Section):
    """A LoRA merged into the DiT for the whole job."""

    path: str = Field(..., description="LoRA file (local or s3://), ComfyUI / kohya key layout.")
    strength: float = Field(1.0, ge=-10.0, le=10.0, description="Multiplier on the LoRA delta; 1 as trained.")


class RowDefaults(RenderSettings):
    """Defaults for every manifest row: every `RenderSettings` field, plus seed and images_per_prompt.

    Derived from the request model (not a copy of its fields) so a new render setting is a valid
    default and manifest column at once. A row's own value beats the default.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(
        0,
        ge=0,
        lt=2**63,
        description="Seed of a row's first image; image k uses seed + k. "
        "0 so that a job renders the same images on every run.",
    )
    images_per_prompt: int = Field(
        1,
        ge=1,
        le=10_000,
        description="Images per row (consecutive seeds); 1 because a dataset usually wants one per prompt.",
    )

    def settings(self) -> RenderSettings:
        """The `RenderSettings` part (without seed and images_per_prompt)."""
        return RenderSettings(**self.model_dump(exclude=set(ROW_ONLY_DEFAULTS)))


ROW_ONLY_DEFAULTS = ("seed", "images_per_prompt")


class S3Spec(_Section):
    """S3 client settings for every s3:// URI of the job (output, manifest, references, models).

    Credentials are not part of a spec (specs get committed and shared): they come from the
    standard AWS environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, profiles, instance roles).
    """

    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO, SeaweedFS, R2); None = AWS, or AWS_ENDPOINT_URL when set."
    )
    region: str | None = Field(None, description="Region; None = the AWS environment's (AWS_REGION / profile).")
    retry_mode: Literal["standard", "adaptive", "legacy"] = Field(
        "adaptive",
        description="boto3 retry mode; adaptive also rate-limits the client when S3 throttles (503 SlowDown).",
    )
    max_attempts: int = Field(
        10, ge=1, le=100, description="boto3 attempts per request; 10 rides out short throttling."
    )

    def options(self) -> S3Options:
        """The storage layer's `S3Options` (credentials from the environment)."""
        return S3Options(
            endpoint_url=self.endpoint_url,
            region=self.region,
            retry_mode=self.retry_mode,
            max_attempts=self.max_attempts,
        )


class OutputSpec(_Section):
    """Where and how the images, metadata and errors are written."""

    uri: str = Field(
        "./output",
        description="Output root, a local folder or s3://bucket/prefix; a local folder "
        "by default so a first run needs no cloud setup.",
    )
    image_format: Literal["png", "webp", "jpeg"] = Field(
        "png",
        description="png is lossless and carries the generation parameters in text chunks; webp/jpeg are smaller.",
    )
    embed_images: bool = Field(
        False,
        description="Also store image bytes in the Parquet `image` column (Hugging Face datasets loads PIL "
        "images); off by default because it doubles storage.",
    )
    append: bool = Field(
        False,
        description="Allow a spec that differs from the one that made the output to add to it; off so that "
        "one output holds one configuration.",
    )
    s3: S3Spec = Field(default_factory=S3Spec, description="S3 client settings, used for every s3:// URI of the job.")
    metadata_flush_seconds: float = Field(
        30.0,
        gt=0.0,
        le=3600.0,
        description="Buffered metadata rows are written as a Parquet part at least this often (and every 256 rows); "
        "a driver killed outright loses at most this long of commits (those items are rendered again on "
        "resume). Shorter means more, smaller parts.",
    )


class ClusterSpec(_Section):
    """Shape of the Ray job: how many workers, where, and how much work each holds."""

    address: str | None = Field(
        None,
        description="Ray cluster address (e.g. 'auto', 'ray://head:10001'); None starts Ray locally, so a "
        "laptop needs no cluster.",
    )
    num_workers: int | None = Field(
        None,
        ge=1,
        description="Exactly this many render workers (min_workers = max_workers = N); None = use "
        "min_workers/max_workers.",
    )
    min_workers: int = Field(
        1,
        ge=1,
        description="Rendering starts once this many workers are ready; 1 so that a job on a cold "
        "autoscaling cluster starts on its first GPU node.",
    )
    max_workers: int | None = Field(
        None,
        ge=1,
        description="Upper bound of the elastic pool: workers that become ready later (nodes the "
        "autoscaler adds) join the running job. None = the GPUs present at start (at "
        "least 1), or cpu_workers for CPU workers; set it on an autoscaling cluster.",
    )
    cpu_workers: int = Field(
        2,
        ge=1,
        description="Workers of a CPU job (device cpu, or a local machine without "
        "GPUs) when max_workers is not set; 2 exercises the distributed "
        "paths on a laptop without starving it.",
    )
    num_cpus_per_worker: float = Field(
        1.0,
        gt=0.0,
        description="CPUs reserved per worker for image encoding and uploads next to the GPU; 1 "
        "keeps those off the sampling critical path.",
    )
    refkv_cache_bytes: int = Field(
        8 * 2**30,
        ge=0,
        description="Per-worker device memory for cached reference K/V (LRU); 8 GiB holds ~8 1 MP "
        "references at bf16 (0.94 GB each) beside the ~5.6 GB of models.",
    )
    max_in_flight_per_worker: int = Field(
        2,
        ge=1,
        description="Calls queued per worker; 2 keeps a worker busy while the driver handles a result, "
        "and bounds driver and object-store memory.",
    )
    max_attempts: int = Field(
        3,
        ge=1,
        description="Tries per item before it is recorded as an error. Only the item's own failures count (an "
        "error raised rendering it); work lost to the cluster (a dead worker or node, a memory-monitor kill, "
        "out of memory) is requeued without an attempt. 3 lets a flaky item through without looping on a "
        "poison one.",
    )
    max_requeues_per_item: int = Field(
        10,
        ge=1,
        description="Budget of requeues for infrastructure failures, for the whole job: this x its items. A "
        "cluster that keeps losing workers ends the job with a message instead of looping; 10 rides out "
        "a node lost every few batches.",
    )
    refkv_fetch_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="Longest a worker waits for a reference's K/V from the object store before encoding it "
        "itself; a lost RefKV is rebuilt only once its creating worker is back (a node boot and a model "
        "load), an encode is one forward. 30 s is far above a 1 GB transfer.",
    )
    max_batch: int = Field(
        4,
        ge=1,
        description="Images of one reference with equal settings sampled in one "
        "batched forward; 4 fills a GPU at 1 MP without running out of memory.",
    )
    device: str = Field(
        "auto",
        description="'auto' = GPU workers (num_gpus=1 each) on a cluster or a local machine "
        "with GPUs, CPU workers on a local machine without; or 'cpu', 'cuda'.",
    )
    transfer_gbps: float | None = Field(
        None,
        gt=0.0,
        description="Cross-node bandwidth in Gbit/s for the fetch-or-re-encode choice of a RefKV held "
        "on another node; None = measured on the job's first cross-node fetch.",
    )
    start_timeout_s: float = Field(
        900.0,
        gt=0.0,
        description="Fail the job when min_workers are not ready after this long; 900 s covers a "
        "GPU node boot plus a model load.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="'auto' = bfloat16 on GPUs that support it (as ComfyUI runs Anima), float32 on CPU."
    )
    compile: bool = Field(
        False,
        description="Run the DiT forward through torch.compile: one graph per resolution and row layout, "
        "the defaults' size compiled at worker start (minutes on a GPU; pays off on long jobs).",
    )
    output_threads: int = Field(
        4,
        ge=0,
        description="Threads per worker that encode, upload and describe images while the next batch "
        "samples; 0 stores inline while the device waits.",
    )

    @model_validator(mode="after")
    def _worker_counts(self) -> ClusterSpec:
        if self.num_workers is not None and self.max_workers is not None:
            raise ValueError("give num_workers (exactly N) or min_workers/max_workers, not both")
        if self.max_workers is not None and self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) is above max_workers ({self.max_workers})")
        return self


class JobSpec(_Section):
    """A batch job: models, adapter, LoRAs, manifest, row defaults, output and cluster shape."""

    models: ModelPaths = Field(..., description="The Anima model files.")
    adapter: str | None = Field(
        None, description="SnapRef adapter file (anima_ref_kv/1); None = adapter.safetensors from models_dir."
    )
    loras: list[LoRASpec] = Field(
        default_factory=list, description="LoRAs merged into the DiT for the whole job; none by default (plain Anima)."
    )
    manifest: str = Field(
        ..., description="Manifest (CSV, JSONL or Parquet; local or s3://) of reference + prompt rows."
    )
    defaults: RowDefaults = Field(
        default_factory=RowDefaults, description="Defaults for every row field; a row's own value wins."
    )
    output: OutputSpec = Field(default_factory=OutputSpec, description="Where and how results are written.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Ray cluster and worker shape.")
    strict: bool = Field(
        False,
        description="Refuse to start when any row is invalid; off so that a few bad rows of a large "
        "manifest go to the errors table and the rest renders.",
    )
    allow_empty_prompt: bool = Field(
        False,
        description="Accept rows with an empty scene prompt; off because an empty prompt is almost always "
        "a broken manifest, not an intent.",
    )

    def s3_options(self) -> S3Options:
        """S3 client settings for every s3:// URI of this job."""
        return self.output.s3.options()

    def model_files(self, models_dir: str | os.PathLike | None = None) -> ModelFiles:
        """All local model files of the job, the adapter included (the spec's, else models_dir's).

        `models_dir` replaces the spec's (a node-local copy of an s3:// one); see `ModelPaths.resolve`.
        """
        files = self.models.resolve(models_dir)
        adapter = self.adapter if self.adapter is not None else files.adapter
        if adapter is None:
            raise ModelFilesError(
                "no SnapRef adapter: set `adapter:` in the job spec, or put adapter.safetensors "
                f"in models_dir ({self.models.models_dir})"
            )
        if _is_remote(os.fspath(adapter)):
            raise ModelFilesError(f"adapter {adapter} is remote: fetch it first")
        return ModelFiles(
            dit=files.dit,
            text_encoder=files.text_encoder,
            vae=files.vae,
            qwen_tokenizer=files.qwen_tokenizer,
            t5_tokenizer=files.t5_tokenizer,
            adapter=Path(adapter),
        )

    def resolve_paths(self, base: str) -> JobSpec:
        """A copy with relative local paths resolved against `base` (a folder or s3:// prefix).

        Only paths set explicitly are resolved; the output default stays relative to the
        current directory.
        """

        def fix(path: str | None) -> str | None:
            return None if path is None else resolve_relative(path, base)

        models = self.models.model_copy(
            update={name: fix(getattr(self.models, name)) for name in ("models_dir", *_EXPLICIT_MODEL_FIELDS)}
        )
        loras = [lora.model_copy(update={"path": fix(lora.path)}) for lora in self.loras]
        output = self.output
        if "uri" in output.model_fields_set:
            output = output.model_copy(update={"uri": fix(output.uri)})
        return self.model_copy(
            update={
                "models": models,
                "loras": loras,
                "adapter": fix(self.adapter),
                "manifest": fix(self.manifest),
                "output": output,
            }
        )


# ---------------------------------------------------------------------------------------------
# Loading


def read_yaml_mapping(path_or_uri: str, s3: S3Options | None = None, *, what: str = "spec") -> dict[str, Any]:
    """The top-level mapping of a YAML file (local or s3://); `JobSpecError`s name the file."""
    try:
        text = read_uri(path_or_uri, s3)
    except Exception as exc:
        if "://" not in path_or_uri and not os.path.exists(path_or_uri):
            raise JobSpecError(f"{what} {path_or_uri} not found") from exc
        raise JobSpecError(f"cannot read {what} {path_or_uri}: {exc}") from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobSpecError(f"{path_or_uri}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise JobSpecError(f"{path_or_uri}: expected a mapping of spec fields at the top, found {type(raw).__name__}")
    return raw


def load_job_spec(path_or_uri: str, s3: S3Options | None = None) -> JobSpec:
    """Load a YAML job spec (local or s3://); relative paths resolve against its folder.

    Errors are `JobSpecError`s naming the file and each bad field by its path, e.g.
    `job.yaml: defaults.sampeler: Extra inputs are not permitted`.
    """
    raw = read_yaml_mapping(path_or_uri, s3, what="job spec")
    spec = _validate(raw, path_or_uri)
    return spec.resolve_paths(manifest_base(path_or_uri))


def quick_spec(
    manifest: str, models_dir: str, adapter: str | None, out: str, workers: int | None = None, **overrides: Any
) -> JobSpec:
    """The spec behind `snapref-ray render MANIFEST --models DIR --adapter FILE --out DIR_OR_S3_URI`.

    `overrides` are flat keyword arguments routed by name: row defaults (`steps=20`, `seed=7`),
    top-level fields (`strict=True`, `loras=[...]`), cluster fields (`max_batch=2`) and output
    fields (`image_format="webp"`). Local paths become absolute against the current directory.
    """
    sections: dict[str, dict[str, Any]] = {"defaults": {}, "cluster": {}, "output": {}}
    raw: dict[str, Any] = {"manifest": manifest, "models": {"models_dir": models_dir}, "adapter": adapter}
    routes = {
        "defaults": RowDefaults.model_fields,
        "cluster": ClusterSpec.model_fields,
        "output": OutputSpec.model_fields,
    }
    for key, value in overrides.items():
        targets = [name for name, fields in routes.items() if key in fields]
        if key in JobSpec.model_fields and key not in ("models", "manifest", "adapter", *routes):
            raw[key] = value
        elif len(targets) == 1:
            sections[targets[0]][key] = value
        else:
            raise JobSpecError(
                f"quick_spec: unknown setting {key!r}"
                if not targets
                else f"quick_spec: setting {key!r} is ambiguous ({', '.join(targets)})"
            )
    sections["output"]["uri"] = out
    if workers is not None:
        sections["cluster"]["num_workers"] = workers
    raw.update(sections)
    spec = _validate(raw, "command line")
    return spec.resolve_paths(os.getcwd())


def _validate(raw: dict[str, Any], source: str) -> JobSpec:
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as exc:
        lines = [f"{_loc(error['loc'])}: {_message(error)}" for error in exc.errors()]
        raise JobSpecError(f"invalid job spec {source}:\n  " + "\n  ".join(lines)) from None


def _message(error: dict) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown field" + _suggestion(error["loc"])
    return error["msg"].removeprefix("Value error, ")


def _suggestion(loc: tuple) -> str:
    """' (did you mean 'sampler'?)' for a misspelt field, found among the fields of its section."""
    model: type[BaseModel] | None = JobSpec
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # an item of a list: its model is the list's item type, found below
        field = model.model_fields.get(part) if model else None
        types = (field.annotation, *get_args(field.annotation)) if field else ()
        model = next((t for t in types if isinstance(t, type) and issubclass(t, BaseModel)), None)
    if model is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _loc(loc: tuple) -> str:
    """pydantic's ('loras', 0, 'strength') as 'loras[0].strength'."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


# ---------------------------------------------------------------------------------------------
# Fingerprint


def spec_fingerprint(spec: JobSpec) -> dict[str, Any]:
    """What determines the images of a job: models, adapter, LoRAs, row defaults, manifest, format.

    Cluster shape, output location and error policy are left out: running the same job on a
    bigger cluster or resuming it elsewhere must not count as a different job. `dtype` is in
    (float32 vs bfloat16 changes pixels when set explicitly). Model files are identified by
    their (resolved) paths, not their contents: hashing gigabytes at every start is too slow.
    """
    return {
        "models": spec.models.model_dump(),
        "adapter": spec.adapter,
        "loras": [lora.model_dump() for lora in spec.loras],
        "defaults": spec.defaults.model_dump(mode="json"),
        "manifest": spec.manifest,
        "image_format": spec.output.image_format,
        "dtype": spec.cluster.dtype,
    }
