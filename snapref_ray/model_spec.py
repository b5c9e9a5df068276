"""What a render runs on: model files, reference adapter, LoRAs, dtype, device, compile (and its cache), quantize.

`ModelSpec` is the one description of a loaded model, embedded unchanged wherever a renderer is
made: a job spec (`model:`), an evaluation or timing spec (`model:`), the serve config (`model:`),
Ray Data's `SnapRefRenderer(model=...)` and the command line (`--models`, `--adapter`, `--lora`,
`--device`, `--dtype`, `--compile`, `--quantize`; `snapref_ray.cli_flags`). A field means
the same thing in all of them. Turning a spec into a loaded `Renderer` (s3:// files fetched once per
node) is `snapref_ray.service.loading.load_renderer`.

Paths may be local or s3:// URIs. Relative local paths in a spec file resolve against that file's
folder (`resolve_paths`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from snapref_ray.models.bundle import ModelFiles, ModelFilesError, resolve_model_files
from snapref_ray.uris import is_remote, resolve_relative

Dtype = Literal["auto", "bfloat16", "float16", "float32"]
Quantize = Literal["none", "fp8"]

MODEL_FILE_FIELDS = ("dit", "text_encoder", "vae", "qwen_tokenizer", "t5_tokenizer")


class LoRASpec(BaseModel):
    """A LoRA merged into the DiT for everything the renderer draws."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(..., description="LoRA file (local or s3://), ComfyUI / kohya / PEFT key layout.")
    strength: float = Field(1.0, ge=-10.0, le=10.0, description="Multiplier on the LoRA delta; 1 as trained.")

    @classmethod
    def parse(cls, text: str) -> LoRASpec:
        """`PATH[:STRENGTH]` as the command line writes it (a path that exists is taken whole, colons and all)."""
        path, sep, strength = text.rpartition(":")
        if not sep or os.path.exists(text) or not _is_number(strength):
            return cls(path=text)
        return cls(path=path, strength=float(strength))


class ModelSpec(BaseModel):
    """The model a renderer loads; the same fields in job specs, the serve config, Ray Data and the CLI."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models_dir: str | None = Field(
        None,
        description="Folder (local or s3://) with the model files: the names `snapref-ray make-tiny` writes"
        " or ComfyUI's split files (docs/python-api.md); the simplest way to point at both the tiny test"
        " models and a ComfyUI models folder. `--models` on the command line.",
    )
    dit: str | None = Field(None, description="DiT + LLM adapter file; overrides the one found in models_dir.")
    text_encoder: str | None = Field(None, description="Qwen3-0.6B base text encoder file; overrides models_dir's.")
    vae: str | None = Field(None, description="Qwen-Image VAE file; overrides models_dir's.")
    qwen_tokenizer: str | None = Field(
        None, description="Qwen tokenizer folder; overrides models_dir's tokenizers/qwen."
    )
    t5_tokenizer: str | None = Field(None, description="T5 tokenizer folder; overrides models_dir's tokenizers/t5.")
    adapter: str | None = Field(
        None,
        description="Reference adapter file: SnapRef anima_ref_kv/1, ArcAnima v2 or pilot (the kind is read"
        " from the file). None = adapter.safetensors in models_dir when there is one.",
    )
    loras: tuple[LoRASpec, ...] = Field(
        (), description="LoRAs merged into the DiT (a style or turbo LoRA); none by default (plain Anima)."
    )
    device: str = Field(
        "auto",
        description="'auto' = a GPU where the process has one (a job on a cluster asks Ray for one per worker),"
        " else the CPU; or 'cpu', 'cuda', 'cuda:1'.",
    )
    dtype: Dtype = Field("auto", description="'auto' = bfloat16 on a GPU (as ComfyUI runs Anima), float32 on the CPU.")
    compile: bool = Field(
        False,
        description="Run the DiT forward through torch.compile: its block compiled once for every block, one graph"
        " per resolution and reading-row layout, batch sizes sharing one (seconds to a minute per graph on a GPU;"
        " pays off on long jobs and busy endpoints).",
    )
    compile_cache: str | None = Field(
        None,
        description="Where compiled DiT graphs are shared with the cluster's other workers: a local folder or an"
        " s3:// prefix (models/compile_cache.py). A worker loads the graphs found there instead of building them"
        " (seconds instead of minutes) and publishes the ones it builds. None = compile/ beside the node's model"
        " cache, shared by the node's workers only; point it at s3:// to share across nodes. Used with compile.",
    )
    quantize: Quantize = Field(
        "none",
        description="'fp8': the DiT's block linears run as float8 e4m3 with per-row scales (a GPU of compute"
        " capability >= 8.9; the CPU runs it slowly, for checks). Everything else stays in `dtype`.",
    )

    @model_validator(mode="before")
    @classmethod
    def _folder_shorthand(cls, value: Any) -> Any:
        # `model: /path/to/models` is a spec of that folder.
        return {"models_dir": value} if isinstance(value, (str, os.PathLike)) else value

    @model_validator(mode="after")
    def _dir_or_files(self) -> ModelSpec:
        missing = [name for name in MODEL_FILE_FIELDS if getattr(self, name) is None]
        if self.models_dir is None and missing:
            raise ValueError(f"give models_dir, or every model file; missing: {', '.join(missing)}")
        return self

    def is_remote(self) -> bool:
        """Whether any file is an s3:// URI (fetched into a node-local cache before loading)."""
        paths = [self.models_dir, self.adapter, *(getattr(self, n) for n in MODEL_FILE_FIELDS)]
        return any(is_remote(p) for p in [*paths, *(lora.path for lora in self.loras)])

    def resolve_paths(self, base: str) -> ModelSpec:
        """A copy with relative local paths resolved against `base` (a folder or s3:// prefix)."""

        def fix(path: str | None) -> str | None:
            return None if path is None else resolve_relative(path, base)

        return self.model_copy(
            update={
                **{name: fix(getattr(self, name)) for name in ("models_dir", "adapter", *MODEL_FILE_FIELDS)},
                "loras": tuple(lora.model_copy(update={"path": fix(lora.path)}) for lora in self.loras),
            }
        )

    def local_files(self, models_dir: str | os.PathLike | None = None) -> ModelFiles:
        """The local model files: explicit ones as given, the rest (and the adapter) from the folder convention.

        `models_dir` replaces the spec's (a node-local copy of an s3:// one). Remote explicit files must
        be fetched by the caller first (`load_renderer` does): this raises `ModelFilesError` for any
        s3:// path it would have to return.
        """
        folder = os.fspath(models_dir) if models_dir is not None else self.models_dir
        explicit = {name: getattr(self, name) for name in MODEL_FILE_FIELDS}
        adapter = self.adapter
        if folder is not None:
            if is_remote(folder):
                raise ModelFilesError(f"models_dir {folder} is remote: fetch it into a local folder and pass that")
            if not all(explicit.values()) or adapter is None:
                found = resolve_model_files(folder)
                explicit = {name: value or os.fspath(getattr(found, name)) for name, value in explicit.items()}
                if adapter is None and found.adapter is not None:
                    adapter = os.fspath(found.adapter)
        remote = [f"{name}={path}" for name, path in {**explicit, "adapter": adapter}.items() if is_remote(path)]
        if remote:
            raise ModelFilesError(f"model files are remote ({', '.join(remote)}): fetch them first")
        return ModelFiles(
            adapter=Path(adapter) if adapter else None, **{name: Path(path) for name, path in explicit.items()}
        )

    def fingerprint(self) -> dict[str, Any]:
        """What changes the pixels: the files (by path), adapter, LoRAs, dtype and quantisation.

        Device, compile and the compile cache are left out: the same job on another GPU, or compiled,
        draws the same images (within the float rounding any two devices differ by).
        """
        return self.model_dump(mode="json", exclude={"device", "compile", "compile_cache"})


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
