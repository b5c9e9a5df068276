"""The YAML job spec: the model, row defaults, output and cluster shape.

One typed object (`JobSpec`) for a batch job, whichever way it is started: a YAML file
(`load_job_spec`), the command line's flags as nested fields over it or alone (cli_flags.py
`render_spec`: `with_overrides`, `from_fields`), or Python keywords (`quick_spec`). Row settings are the request
model's (`RenderSettings`) fields, so `defaults:` in a spec, a manifest column, a CLI flag and an
HTTP field all mean the same thing; `model:` is the one `ModelSpec` that the serve config, Ray Data
and the command line embed too.

Relative local paths written in a spec file resolve against the spec file's folder (so a spec
and its manifest can travel together); defaults that the file does not set (output `./output`)
are relative to the current directory. `quick_spec` makes local paths absolute against the
current directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Self, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from snapref_ray.model_spec import LoRASpec, ModelSpec
from snapref_ray.render_service.judges.spec import JudgeSpec
from snapref_ray.requests import RowDefaults
from snapref_ray.storage.backends import S3Options, read_uri
from snapref_ray.uris import base_of, resolve_relative
from snapref_ray.validation import format_validation_error

S = TypeVar("S", bound="SpecFile")
M = TypeVar("M", bound=BaseModel)


class JobSpecError(ValueError):
    """A job spec that cannot be loaded: the message names the file and the field path."""


class _Section(BaseModel):
    # extra="forbid": a typo'd key in a spec is an error, not a silently ignored setting.
    model_config = ConfigDict(extra="forbid")


class SpecFile(_Section):
    """A spec read from a YAML file: relative local paths in it resolve against the file's folder.

    `PATH_FIELDS` names the plain path fields; a `model` (ModelSpec), LoRASpec fields and an output
    `uri` the file sets are resolved too. The output default stays relative to the current directory.
    """

    PATH_FIELDS: ClassVar[tuple[str, ...]] = ()

    def resolve_paths(self, base: str):
        """A copy with relative local paths resolved against `base` (a folder or s3:// prefix)."""
        update: dict[str, Any] = {}
        for name in self.PATH_FIELDS:
            value = getattr(self, name)
            update[name] = None if value is None else resolve_relative(value, base)
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, (ModelSpec, LoRASpec)):
                update[name] = (
                    value.resolve_paths(base)
                    if isinstance(value, ModelSpec)
                    else value.model_copy(update={"path": resolve_relative(value.path, base)})
                )
            elif isinstance(value, OutputSpec) and "uri" in value.model_fields_set:
                update[name] = value.model_copy(update={"uri": resolve_relative(value.uri, base)})
        return self.model_copy(update=update)

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any], source: str = "command line") -> Self:
        """A spec of nested `fields` alone (no file under them), validated as a file's would be, naming `source`.
        Paths are taken as given."""
        return validate_spec(dict(fields), cls, source)

    def with_overrides(self, overrides: Mapping[str, Any], source: str = "command line") -> Self:
        """This spec with `overrides` over it (nested fields: a mapping goes into its section, any other value
        replaces the field's), validated as a whole, so that a flag's bad value is refused as the field's would be,
        naming it. Paths are taken as given (the command line's are relative to the current directory)."""
        return validate_spec(_overlay(self.model_dump(), overrides), type(self), source)


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
    rerender_changed: bool = Field(
        False,
        description="Render again the rows whose explicit `id` the output already holds with other content (an "
        "edited row): their new images replace the old. Off, such a run is refused naming the rows, so that an id "
        "never silently keeps an image its row no longer describes.",
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
    format: Literal["files", "webdataset"] = Field(
        "files",
        description="files: one image (and thumbnail) object per item, easy to browse, right up to ~100k images. "
        "webdataset: each worker writes tar shards (image, JSON record, prompt per item) with a Parquet index, a "
        "few objects per thousand images, what training loaders read (storage/shards.py).",
    )
    shard_max_bytes: int = Field(
        1_000_000_000,
        ge=1_000_000,
        description="A webdataset shard is closed at this size: ~1 GB keeps the object count low and a shard "
        "quick to download; a worker spools it on local disk (and holds nothing of it in memory).",
    )
    shard_max_items: int = Field(
        10_000,
        ge=1,
        description="...or at this many items, whichever comes first (small images would otherwise make huge "
        "shard indexes).",
    )
    thumbnail_every: int = Field(
        1000,
        ge=1,
        description="With webdataset, a thumbnail for about one item in this many (chosen by a hash of the id) "
        "for the gallery, rather than one object per image: 1 in 1000 is 10,000 previews for 10 M images, and "
        "adds one object per 1000 images to the shards' few.",
    )
    lease_seconds: float = Field(
        60.0,
        ge=3.0,
        le=3600.0,
        description="How long the driver's lease on the output lasts without renewal (storage/lease.py); it is "
        "renewed every third of this while the job runs, so a killed driver blocks the next run at most this long.",
    )
    lease_wait_seconds: float = Field(
        0.0,
        ge=0.0,
        description="When another driver holds the output: 0 refuses at once with a line naming it; more waits up "
        "to this long for it to finish (an orchestrator's retry that may overlap the first run).",
    )

    @model_validator(mode="after")
    def _embed_needs_files(self) -> OutputSpec:
        if self.format == "webdataset" and self.embed_images:
            raise ValueError("embed_images needs format: files (a webdataset shard holds the images already)")
        if self.format == "webdataset" and self.rerender_changed:
            raise ValueError(
                "rerender_changed needs format: files (the shard that holds an id's old image cannot drop it, so the "
                "id would be in two shards); give the edited rows new ids"
            )
        return self


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
    memory_per_worker: int | None = Field(
        None,
        ge=0,
        description="Bytes of host memory each worker asks Ray for (`memory=`), so Ray never packs more workers"
        " on a node than fit and a CPU worker fits its batches inside it. None = estimated from the model files"
        " and the job's largest image at max_batch (docs/jobs.md, Memory); 0 = ask for none.",
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


# Where fields of earlier job specs went: a spec that still uses them is refused with the new place.
_MOVED = {
    "models": "model.models_dir (or model.dit, model.vae, ...)",
    "adapter": "model.adapter",
    "loras": "model.loras",
    "cluster.device": "model.device",
    "cluster.dtype": "model.dtype",
    "cluster.compile": "model.compile",
}


class JudgeSection(JudgeSpec):
    """A job's `judge:` section: the checks (`JudgeSpec`: each check's name -> its settings, `{}` for the
    defaults) and how the job loops over rejects (docs/judging.md, "In a batch job")."""

    max_renders_per_item: int = Field(
        3,
        ge=1,
        le=100,
        description="Renders an item gets at most: a rejected render is rendered again with the next seed of"
        " its sequence until one is kept or this many were made. 3: a check that rejects a third of renders"
        " leaves about 4 % of items without a kept image, at 1.5x the renders.",
    )
    kept_per_reference: int | None = Field(
        None,
        ge=1,
        description="Images kept per reference at most; once a reference has this many, its remaining items"
        " are skipped (counted in summary.json). None: every item may keep one image.",
    )
    keep_rejected_images: bool = Field(
        True,
        description="Keep a rejected render's image (for auditing, and for the report's gallery, where rejected renders"
        " stand beside the kept ones). Off: its row and scores stay, its image does not — a file is deleted; a"
        " webdataset shard holding one is committed as a copy without it, made by a Ray task (docs/judging.md).",
    )

    def checks_spec(self) -> JudgeSpec:
        """The checks alone, as every door's `JudgeSpec` (what the workers score with)."""
        return JudgeSpec.model_validate({name: getattr(self, name) for name in self.checks})


class JobSpec(SpecFile):
    """A batch job: the model, manifest, row defaults, output and cluster shape."""

    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("manifest",)

    model: ModelSpec = Field(
        ...,
        description="The model every worker loads (docs/jobs.md; the same `ModelSpec` "
        "as the serve config, Ray Data and the command line).",
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
    judge: JudgeSection | None = Field(
        None,
        description="Judge every render, re-render the rejected ones and count kept images per reference"
        " (docs/judging.md). None: every render is kept, as rendered.",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_fields(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            cluster = raw.get("cluster") if isinstance(raw.get("cluster"), dict) else {}
            used = [k for k in ("models", "adapter", "loras") if k in raw]
            used += [f"cluster.{k}" for k in ("device", "dtype", "compile") if k in cluster]
            if used:
                moves = "; ".join(f"{old} -> {_MOVED[old]}" for old in used)
                raise ValueError(f"these fields moved into the `model:` section: {moves}")
        return raw

    def s3_options(self) -> S3Options:
        """S3 client settings for every s3:// URI of this job."""
        return self.output.s3.options()


def _overlay(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        inner = merged.get(key)
        merged[key] = _overlay(inner, value) if isinstance(value, Mapping) and isinstance(inner, dict) else value
    return merged


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
    `job.yaml: defaults.sampeler: unknown field (did you mean 'sampler'?)`.
    """
    return load_spec_file(path_or_uri, JobSpec, s3, what="job spec")


def load_spec_file(path_or_uri: str, model: type[S], s3: S3Options | None = None, *, what: str = "spec") -> S:
    """Load a YAML spec (local or s3://) into `model` (a `SpecFile`); relative paths resolve against its folder."""
    raw = read_yaml_mapping(path_or_uri, s3, what=what)
    return validate_spec(raw, model, path_or_uri, what=what).resolve_paths(base_of(path_or_uri))


def validate_spec(raw: dict[str, Any], model: type[M], source: str, *, what: str = "job spec") -> M:
    """`model` from `raw`, or a `JobSpecError` naming `source` and every bad field by its path."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        lines = format_validation_error(exc, model)
        raise JobSpecError(f"invalid {what} {source}:\n  " + "\n  ".join(lines)) from None


def quick_spec(manifest: str, out: str, *, model: ModelSpec, workers: int | None = None, **overrides: Any) -> JobSpec:
    """The spec behind `snapref-ray render MANIFEST --models DIR [--adapter FILE] --out DIR_OR_S3_URI`.

    `overrides` are flat keyword arguments routed by name: row defaults (`steps=20`, `seed=7`),
    top-level fields (`strict=True`), cluster fields (`max_batch=2`) and output fields
    (`image_format="webp"`). Local paths become absolute against the current directory.
    """
    sections: dict[str, dict[str, Any]] = {"defaults": {}, "cluster": {}, "output": {}}
    raw: dict[str, Any] = {"manifest": manifest, "model": model.model_dump()}
    routes = {
        "defaults": RowDefaults.model_fields,
        "cluster": ClusterSpec.model_fields,
        "output": OutputSpec.model_fields,
    }
    for key, value in overrides.items():
        targets = [name for name, fields in routes.items() if key in fields]
        if key in JobSpec.model_fields and key not in ("model", "manifest", *routes):
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
    spec = validate_spec(raw, JobSpec, "command line")
    return spec.resolve_paths(os.getcwd())


# ---------------------------------------------------------------------------------------------
# Fingerprint


def spec_fingerprint(spec: JobSpec) -> dict[str, Any]:
    """What determines the images of a job: the model, row defaults, manifest and image format.

    Cluster shape, output location and error policy are left out: running the same job on a
    bigger cluster or resuming it elsewhere must not count as a different job. Model files are
    identified by their (resolved) paths, not their contents: hashing gigabytes at every start is
    too slow (`ModelSpec.fingerprint`).
    """
    return {
        "model": spec.model.fingerprint(),
        "defaults": spec.defaults.model_dump(mode="json"),
        "manifest": spec.manifest,
        "image_format": spec.output.image_format,
        # Only when sharded, so the fingerprints of outputs made before the format existed stay the same.
        **({"format": spec.output.format} if spec.output.format != "files" else {}),
        # Only when judged: the checks, their thresholds and the loop decide which images are kept.
        **({"judge": spec.judge.model_dump(mode="json")} if spec.judge is not None else {}),
    }
