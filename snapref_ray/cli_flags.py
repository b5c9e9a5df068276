"""Command-line flags generated from the shared models, so a flag means what its field means.

`--steps`, `--ref-weight`, ... are `RenderSettings` fields; `--models`, `--adapter`, `--lora`,
`--device`, `--dtype`, `--compile`, `--quantize`, `--dit`, ... are `ModelSpec` fields. Every subcommand
that renders (`txt2img`, `render`, `serve`, `timing`, `eval`) takes them from here; `render`'s flags become its
job spec here (`render_spec`), as nested fields over the spec file's, validated with them in one pass.
"""

from __future__ import annotations

import argparse
import os
import typing
from typing import TYPE_CHECKING, Any

from snapref_ray.model_spec import LoRASpec, ModelSpec
from snapref_ray.requests import RenderSettings

if TYPE_CHECKING:
    from snapref_ray.job_spec import JobSpec

# ModelSpec field -> flag, where the flag is not simply the field's name.
_MODEL_FLAG_NAMES = {"models_dir": "--models", "loras": "--lora"}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """`--help` that shows a flag's default after its text (unless the text says it already, or there is none)
    and keeps the line breaks of descriptions and examples."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        none = default is None or default is False or default is argparse.SUPPRESS or default == []
        if not action.option_strings or "default" in text or none:
            return text
        return f"{text} (default: {str(default).replace('%', '%%')})"


def _with_default(description: str | None, info) -> str:
    """A field's description, and its default where it has one (the flags themselves default to "not given", so
    that a spec file's value is kept)."""
    text = description or ""
    default = info.get_default(call_default_factory=True)
    if default is None or "default" in text.lower():
        return text
    if isinstance(default, bool):
        default = "on" if default else "off"
    return f"{text} (default: {str(default).replace('%', '%%')})"


def _field_type(annotation) -> type:
    """int, float, bool or str for a field annotation; `X | None` counts as X."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and type(None) in typing.get_args(annotation):
        annotation = args[0] if len(args) == 1 else annotation
    return annotation if annotation in (int, float, bool) else str


def _choices(annotation) -> tuple | None:
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    return None


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for every RenderSettings field, named like the field (--ref-weight for ref_weight)."""
    for name, info in RenderSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind = _field_type(info.annotation)
        text = _with_default(info.description, info)
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            parser.add_argument(flag, dest=name, type=kind, default=None, help=text)


def settings_from(args: argparse.Namespace) -> RenderSettings:
    """The RenderSettings of the flags that were given (the rest keep their defaults)."""
    return RenderSettings(**settings_overrides(args))


def settings_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in RenderSettings.model_fields if getattr(args, name, None) is not None}


def add_model_flags(parser: argparse.ArgumentParser, *, models_required: bool = False) -> None:
    """A flag for every ModelSpec field (`--models` for models_dir, `--lora PATH[:STRENGTH]` repeatable)."""
    group = parser.add_argument_group("model (the fields of `model:` in a job spec or serve config)")
    for name, info in ModelSpec.model_fields.items():
        flag = _MODEL_FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
        dest = f"model_{name}"
        if name == "loras":
            group.add_argument(
                flag,
                dest=dest,
                action="append",
                type=LoRASpec.parse,
                default=None,
                metavar="PATH[:STRENGTH]",
                help=info.description + " Repeatable.",
            )
        elif _field_type(info.annotation) is bool:
            group.add_argument(
                flag,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=_with_default(info.description, info),
            )
        else:
            choices = _choices(info.annotation)
            group.add_argument(
                flag,
                dest=dest,
                default=None,
                choices=choices,
                required=models_required and name == "models_dir",
                # The field's name, not the internal dest (`model_dit`): `--dit DIT`, `--models DIR`.
                metavar=None if choices else "DIR" if name == "models_dir" else name.upper(),
                help=_with_default(info.description, info),
            )


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ModelSpec fields the flags gave."""
    given = {name: getattr(args, f"model_{name}", None) for name in ModelSpec.model_fields}
    return {name: value for name, value in given.items() if value is not None}


def model_spec_from(args: argparse.Namespace, base: ModelSpec | None = None) -> ModelSpec:
    """The ModelSpec of the flags, over `base` (a spec file's `model:`) when there is one. `--compile-cache` where
    nothing compiles is a usage error: the flag would otherwise be ignored without a word."""
    overrides = model_overrides(args)
    spec = ModelSpec.model_validate(overrides if base is None else {**base.model_dump(), **overrides})
    if "compile_cache" in overrides and not spec.compile:
        raise ValueError(compile_cache_without_compile(overrides["compile_cache"]))
    return spec


def compile_cache_without_compile(cache: str) -> str:
    return (
        f"--compile-cache {cache} is where compiled graphs are shared, and nothing compiles:"
        " add --compile (model.compile: true in a spec), or leave --compile-cache out"
    )


def worker_count_overrides(workers: int | None, min_workers: int | None = None, max_workers: int | None = None) -> dict:
    """A spec's `cluster:` fields for `--workers N` (a count in place of the spec's range) or `--min-workers` /
    `--max-workers` (a range in place of its count); the spec's validation refuses both kinds at once."""
    given = {k: v for k, v in (("min_workers", min_workers), ("max_workers", max_workers)) if v is not None}
    if workers is not None:
        return {"num_workers": workers, "max_workers": None, **given}
    return {"num_workers": None, **given} if given else {}


def render_spec(args: argparse.Namespace) -> JobSpec:
    """The JobSpec of `render`'s arguments: a spec file with the flags over it, or the quick form (a manifest, and
    the flags for the rest). The flags go through the spec's own validation (`SpecFile.with_overrides`), so a bad
    value is refused naming its field; their relative paths are the current directory's, made absolute as the
    file's own are against its folder: the job's fingerprint names each file once, however it was spelled."""
    from snapref_ray.job_spec import JobSpec, load_job_spec

    target = args.spec_or_manifest
    overrides = render_overrides(args)
    if _is_spec_file(target):
        spec = load_job_spec(target).with_overrides(overrides)
    else:
        spec = JobSpec.from_fields({"manifest": target, **overrides}, "command line")
    spec = spec.resolve_paths(os.getcwd())
    if "compile_cache" in overrides["model"] and not spec.model.compile:
        raise ValueError(compile_cache_without_compile(overrides["model"]["compile_cache"]))
    if spec.judge is not None and not spec.judge.checks:
        raise ValueError("--max-renders-per-item and --kept-per-reference need --judge CHECKS (or a spec's judge:)")
    return spec


def _is_spec_file(target: str) -> bool:
    """`render SPEC.yaml` (a job spec file) rather than `render MANIFEST` (the quick form)."""
    return target.endswith((".yaml", ".yml"))


def render_overrides(args: argparse.Namespace) -> dict:
    """What `render`'s flags set, as the job spec's nested fields (`SpecFile.with_overrides`).

    `--judge CHECKS` names the checks that run (a check the spec sets up keeps its settings; the others are off);
    `--max-renders-per-item` / `--kept-per-reference` set the loop over the spec's `judge:` or the flag's."""
    from snapref_ray.render_service.judges.spec import CHECKS, JudgeSpec

    if args.strict and args.allow_invalid:
        raise ValueError("--strict refuses to start on an invalid row and --allow-invalid accepts them: give one")
    if not _is_spec_file(args.spec_or_manifest) and (not args.model_models_dir or not args.out):
        raise ValueError("the quick form needs --models DIR and --out DIR_OR_S3_URI (snapref-ray render --help)")
    output = {
        name: value
        for name, value in (
            ("uri", args.out),
            ("append", args.append or None),
            ("rerender_changed", args.rerender_changed or None),
            ("lease_wait_seconds", args.wait_for_lease),
        )
        if value is not None
    }
    overrides: dict = {
        "defaults": settings_overrides(args),  # --steps, --seed, ...: a row's defaults
        "model": model_overrides(args),
        "cluster": worker_count_overrides(args.workers, args.min_workers, args.max_workers),
        "output": output,
        **({"strict": True} if args.strict else {}),
    }
    judge = {
        name: value
        for name, value in (
            ("max_renders_per_item", args.max_renders_per_item),
            ("kept_per_reference", args.kept_per_reference),
        )
        if value is not None
    }
    if args.job_judge is not None:
        named = JudgeSpec.of_names(args.job_judge).checks
        judge.update({name: ({} if name in named else None) for name in CHECKS})
    if judge:
        overrides["judge"] = judge
    return overrides
