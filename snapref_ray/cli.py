"""`snapref-ray ...`: the command line. Each subcommand maps its flags onto the shared models."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import typing
from pathlib import Path

from pydantic import ValidationError

from snapref_ray.eval_cli import add_eval_parsers
from snapref_ray.requests import RenderSettings
from snapref_ray.serve.cli import add_serve_parser

log = logging.getLogger("snapref_ray")


def _field_type(annotation) -> type:
    """int, float, bool or str for a field annotation; `X | None` counts as X."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and type(None) in typing.get_args(annotation):
        annotation = args[0] if len(args) == 1 else annotation
    return annotation if annotation in (int, float, bool) else str


def _settings_flags(p: argparse.ArgumentParser) -> None:
    """Flags for every RenderSettings field, named like the field (--ref-weight for ref_weight)."""
    for name, info in RenderSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind = _field_type(info.annotation)
        if kind is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=info.description)
        else:
            p.add_argument(flag, dest=name, type=kind, default=None, help=info.description)


def _settings_from(args: argparse.Namespace) -> RenderSettings:
    given = {name: getattr(args, name) for name in RenderSettings.model_fields if getattr(args, name, None) is not None}
    return RenderSettings(**given)


def _progress(total_label: str):
    from tqdm import tqdm

    bar = tqdm(total=None, desc=total_label, unit="step")

    def update(step: int, total: int) -> None:
        bar.total = total
        bar.update(1)

    return bar, update


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from snapref_ray.tiny import TinyConfig, make_tiny

    out = make_tiny(args.dir, TinyConfig(num_blocks=args.blocks, seed=args.seed), adapter_kind=args.adapter_kind)
    print(
        f"wrote a tiny model set to {out} (dit, text_encoder, vae, tokenizers, reference.png and"
        f" adapter.safetensors of kind {args.adapter_kind})"
    )
    return 0


def cmd_txt2img(args: argparse.Namespace) -> int:
    from snapref_ray.engine import Renderer
    from snapref_ray.requests import RenderRequest
    from snapref_ray.storage.image_files import encode_rendered_image

    settings = _settings_from(args)
    renderer = Renderer.from_folder(
        args.models,
        adapter=args.adapter,
        loras=[(p, s) for p, s in (_parse_lora(x) for x in args.lora)],
        device=args.device,
        compile=args.compile,
    )
    references = None
    layout = "single"
    if args.reference:
        references = [Path(p).read_bytes() for p in args.reference]
        layout = "multi" if len(references) > 1 else "single"
        if args.reference2:
            if len(args.reference) != 1:
                raise SystemExit("--reference2 (a second character) goes with exactly one --reference")
            references.append(Path(args.reference2).read_bytes())
            layout = "pair"
    init = None
    if args.init_image:
        from PIL import Image

        init = Image.open(args.init_image)
    requests = [RenderRequest(prompt=args.prompt, seed=args.seed + i, settings=settings) for i in range(args.n)]
    bar, update = _progress("sampling")
    with bar:
        results = renderer.render(requests, references=references, layout=layout, init_image=init, progress=update)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for i, result in enumerate(results):
        path = out if len(results) == 1 else out.with_name(f"{out.stem}_{i:03d}{out.suffix}")
        path.write_bytes(
            encode_rendered_image(
                result.image,
                prompt=result.request.prompt,
                seed=result.request.seed,
                settings=settings.model_dump(),
                model=renderer.model_id,
                adapter=renderer.adapter.identity if renderer.adapter else None,
                reference_hash=_reference_hash(references, layout),
                fmt=_format_of(path),
            )
        )
        t = result.timings
        print(
            f"{path}  seed {result.request.seed}  sample {t['sample_s']:.2f} s  decode {t['decode_s']:.2f} s"
            + (f"  reference encode {t['encode_s']:.2f} s" if references else "")
        )
    return 0


def _reference_hash(references: list[bytes] | None, layout: str) -> str | None:
    """The hash a batch job gives the same reference (one file's content hash, or the pair/multi hash)."""
    from snapref_ray.adapter.images import content_hash
    from snapref_ray.storage.work_items import combined_reference_hash

    if not references:
        return None
    hashes = [content_hash(data) for data in references]
    return hashes[0] if layout == "single" else combined_reference_hash(layout, hashes)


def _format_of(path: Path) -> str:
    """png, webp or jpeg from the output file's extension (png when it names none of them)."""
    return {".webp": "webp", ".jpg": "jpeg", ".jpeg": "jpeg"}.get(path.suffix.lower(), "png")


def _parse_lora(text: str) -> tuple[str, float]:
    path, _, strength = text.partition(":") if not Path(text).exists() else (text, "", "")
    return path, float(strength) if strength else 1.0


def cmd_adapter_inspect(args: argparse.Namespace) -> int:
    from snapref_ray.adapter.inspect import format_file_inspection, inspect_file

    info = inspect_file(args.file)
    print(json.dumps(info, indent=2, default=str) if args.json else format_file_inspection(info))
    return 1 if info["kind"] == "unusable" else 0


def cmd_adapter_convert(args: argparse.Namespace) -> int:
    from snapref_ray.adapter.convert import convert

    detection = convert(args.input, args.output, args.map)
    print(f"wrote {args.output}: {detection.kind} ({detection.how}: {detection.reason})")
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from snapref_ray.pipelines.generate_dataset import run_job
    from snapref_ray.storage.jobspec import load_job_spec, quick_spec

    target = args.spec_or_manifest
    if target.endswith((".yaml", ".yml")):
        spec = load_job_spec(target)
        if args.out:
            spec = spec.model_copy(update={"output": spec.output.model_copy(update={"uri": args.out})})
        if args.compile:
            spec = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"compile": True})})
    else:
        if not args.models or not args.out:
            raise SystemExit("the quick form needs --models DIR and --out DIR_OR_S3_URI")
        overrides = {
            name: getattr(args, name)
            for name in (*RenderSettings.model_fields, "min_workers", "max_workers")
            if getattr(args, name, None) is not None
        }
        if args.compile:
            overrides["compile"] = True
        spec = quick_spec(target, args.models, args.adapter, args.out, workers=args.workers, **overrides)
    summary = run_job(spec, progress=not args.no_progress)
    _print_summary(summary)
    return 1 if summary["failed_items"] else 0


def _print_summary(summary: dict) -> None:
    print(
        f"{summary['images_total']} images in {summary['output']} ({summary['images_this_run']} this run, "
        f"{summary['skipped_already_done']} already there, {summary['failed_items']} failed, "
        f"{summary['invalid_rows']} invalid rows); {summary['images_per_hour']:.0f} images/hour, "
        f"{summary['encodes_per_reference']:.2f} encodes per reference"
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from snapref_ray.pipelines.generate_dataset import run_job
    from snapref_ray.storage.jobspec import load_job_spec
    from snapref_ray.tiny import make_tiny

    out = Path(args.out).resolve()
    models = out / "tiny-models"
    if not (models / "dit.safetensors").exists():
        make_tiny(models)
    spec = load_job_spec(str(Path(__file__).parent / "examples" / "example_spec.yaml"))
    spec = spec.model_copy(
        update={
            "models": spec.models.model_copy(update={"models_dir": str(models)}),
            "output": spec.output.model_copy(update={"uri": str(out)}),
        }
    )
    summary = run_job(spec, progress=not args.no_progress)
    _print_summary(summary)
    print(f"open {out / 'gallery.html'} to look at the results")
    return 1 if summary["failed_items"] else 0


def cmd_report(args: argparse.Namespace) -> int:
    from snapref_ray.report import write_report

    result = write_report(args.output)
    print(json.dumps(result, indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="snapref-ray", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="write a tiny random-weight model set (real file layouts) for tests and demos")
    p.add_argument("dir")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--adapter-kind",
        choices=("snapref", "arcanima-v2", "arcanima-pilot"),
        default="snapref",
        help="which kind of reference adapter adapter.safetensors is (default snapref)",
    )
    p.set_defaults(func=cmd_make_tiny)

    p = sub.add_parser("txt2img", help="render images from a prompt (optionally with a SnapRef reference)")
    p.add_argument("--models", required=True, help="model folder (tiny or real)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--out", required=True, help="output PNG path (numbered when --n > 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=1, help="images, consecutive seeds, one batch")
    p.add_argument(
        "--adapter",
        help="reference adapter: SnapRef anima_ref_kv/1, ArcAnima v2 or pilot; the kind is"
        " detected from the file (default: adapter.safetensors in --models if present)",
    )
    p.add_argument(
        "--reference", action="append", default=[], help="reference image; repeat for several of one character"
    )
    p.add_argument("--reference2", help="second character's reference, stitched to the right of --reference")
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        help="standard (style) LoRA to merge, PATH[:STRENGTH]; repeatable. Reference adapters go with --adapter",
    )
    p.add_argument("--init-image", help="input image for img2img (use with --denoise < 1)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--compile", action="store_true", help="DiT forward through torch.compile")
    _settings_flags(p)
    p.set_defaults(func=cmd_txt2img)

    p = sub.add_parser("adapter", help="reference adapter files (SnapRef, ArcAnima v2 and pilot)")
    adapter_sub = p.add_subparsers(dest="adapter_command", required=True)
    q = adapter_sub.add_parser(
        "inspect",
        help="what a file is and why: kind, rank, blocks, linears, dtype,"
        " parameters, the method it implies (also for files it cannot use)",
    )
    q.add_argument("file")
    q.add_argument("--json", action="store_true", help="print the result as JSON")
    q.set_defaults(func=cmd_adapter_inspect)
    q = adapter_sub.add_parser("convert", help="rename the tensors of a file (and set its kind) with a YAML map")
    q.add_argument("input")
    q.add_argument("output")
    q.add_argument("--map", required=True, help="YAML: rename [[PATTERN, REPLACEMENT], ...], drop, kind, metadata")
    q.set_defaults(func=cmd_adapter_convert)

    p = sub.add_parser("render", help="run a batch job: SPEC.yaml, or MANIFEST --models DIR --adapter FILE --out DIR")
    p.add_argument(
        "spec_or_manifest", help="job spec (.yaml) or manifest (.csv/.jsonl/.parquet; columns reference, prompt)"
    )
    p.add_argument("--models", help="model folder (quick form)")
    p.add_argument("--adapter", help="SnapRef adapter (quick form; default: adapter.safetensors in --models)")
    p.add_argument("--out", help="output folder or s3://bucket/prefix")
    p.add_argument("--workers", type=int, help="exactly N render workers (default: --min-workers/--max-workers)")
    p.add_argument("--min-workers", type=int, help="start rendering once N workers are ready (default 1)")
    p.add_argument(
        "--max-workers",
        type=int,
        help="grow the pool up to N workers as the autoscaler adds GPU nodes (default: the GPUs present "
        "at start, or 2 CPU workers on a machine without GPUs)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="DiT forward through torch.compile (cluster.compile in a job spec)",
    )
    _settings_flags(p)
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("demo", help="make the tiny models and render the bundled example on a local Ray")
    p.add_argument("--out", default="demo-output", help="output folder (default ./demo-output)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("report", help="regenerate gallery.html and the throughput plots of a job's output")
    p.add_argument("output", help="the job's output folder or s3://bucket/prefix")
    p.set_defaults(func=cmd_report)

    add_serve_parser(sub)
    add_eval_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except ValidationError as e:
        for err in e.errors():
            field = ".".join(str(x) for x in err["loc"]) or "settings"
            print(f"error: {field}: {err['msg']}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
