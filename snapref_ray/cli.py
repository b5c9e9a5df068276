"""`snapref-ray ...`: the command line. Each subcommand maps its flags onto the shared models."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from snapref_ray.cli_flags import add_model_flags, add_settings_flags, model_spec_from, settings_from
from snapref_ray.eval_cli import add_eval_parsers
from snapref_ray.pipelines.job_summary import JobSummary
from snapref_ray.requests import RenderSettings
from snapref_ray.serve.cli import add_serve_parser
from snapref_ray.validation import run_reporting_usage_errors

log = logging.getLogger("snapref_ray")


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
    from snapref_ray.requests import RenderRequest
    from snapref_ray.service import RefKVKey, RenderService
    from snapref_ray.service.records import encode_output
    from snapref_ray.service.references import ReferenceIdentity

    service = RenderService.load(model_spec_from(args))
    settings = service.resolve(settings_from(args))
    references, layout = _reference_images(args)
    init = None
    if args.init_image:
        from PIL import Image

        init = Image.open(args.init_image)
    requests = [RenderRequest(prompt=args.prompt, seed=args.seed + i, settings=settings) for i in range(args.n)]
    reference_hash = ReferenceIdentity.of_images(layout, references).hash if references else None
    refkv = None
    if references and not settings.recompute_reference_every_step:
        key = RefKVKey.for_settings(reference_hash, settings)
        sources = [*args.reference, *([args.reference2] if args.reference2 else [])]
        refkv, _ = service.refkv(key, layout, lambda: references, sources=sources)
    bar, update = _progress("sampling")
    with bar:
        rendered = service.render(
            requests,
            refkv=refkv,
            references=references if settings.recompute_reference_every_step else None,
            layout=layout,
            reference_hash=reference_hash,
            init_image=init,
            progress=update,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fmt = _format_of(out)
    for i, image in enumerate(rendered):
        path = out if len(rendered) == 1 else out.with_name(f"{out.stem}_{i:03d}{out.suffix}")
        path.write_bytes(encode_output(image, model=service.model_id, adapter=service.adapter_id, fmt=fmt))
        t = image.timings
        encode_s = refkv.encode_seconds if refkv is not None else t.get("encode_s", 0.0)
        print(
            f"{path}  seed {image.request.seed}  sample {t['sample_s']:.2f} s  decode {t['decode_s']:.2f} s"
            + (f"  reference encode {encode_s:.2f} s" if references else "")
        )
    return 0


def _reference_images(args: argparse.Namespace) -> tuple[list[bytes] | None, str]:
    """(the reference files' bytes, layout) of --reference (repeatable) and --reference2."""
    if not args.reference:
        if args.reference2:
            raise ValueError("--reference2 (a second character) goes with exactly one --reference")
        return None, "single"
    references = [_read_file(p, "--reference") for p in args.reference]
    layout = "multi" if len(references) > 1 else "single"
    if args.reference2:
        if len(args.reference) != 1:
            raise ValueError("--reference2 (a second character) goes with exactly one --reference")
        references.append(_read_file(args.reference2, "--reference2"))
        layout = "pair"
    return references, layout


def _read_file(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise FileNotFoundError(f"{flag} {path}: {e.strerror or e}") from None


def _format_of(path: Path) -> str:
    """png, webp or jpeg from the output file's extension (png when it names none of them)."""
    return {".webp": "webp", ".jpg": "jpeg", ".jpeg": "jpeg"}.get(path.suffix.lower(), "png")


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
        update = {"model": model_spec_from(args, spec.model)}
        if args.out:
            update["output"] = spec.output.model_copy(update={"uri": args.out})
        spec = spec.model_copy(update=update)
    else:
        if not args.model_models_dir or not args.out:
            raise ValueError("the quick form needs --models DIR and --out DIR_OR_S3_URI")
        overrides = {
            name: getattr(args, name)
            for name in (*RenderSettings.model_fields, "min_workers", "max_workers")
            if getattr(args, name, None) is not None
        }
        spec = quick_spec(target, args.out, model=model_spec_from(args), workers=args.workers, **overrides)
    if args.wait_for_lease is not None:
        spec = spec.model_copy(
            update={"output": spec.output.model_copy(update={"lease_wait_seconds": args.wait_for_lease})}
        )
    summary = run_job(spec, progress=not args.no_progress)
    _print_summary(summary)
    return 1 if summary.failed_items else 0


def _print_summary(summary: JobSummary) -> None:
    print(
        f"{summary.images_total} images in {summary.output} ({summary.images_this_run} this run, "
        f"{summary.skipped_already_done} already there, {summary.failed_items} failed, "
        f"{summary.invalid_rows} invalid rows); {summary.images_per_hour:.0f} images/hour, "
        f"{summary.encodes_per_reference:.2f} encodes per reference"
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
            "model": spec.model.model_copy(update={"models_dir": str(models)}),
            "output": spec.output.model_copy(update={"uri": str(out)}),
        }
    )
    summary = run_job(spec, progress=not args.no_progress)
    _print_summary(summary)
    print(f"open {out / 'gallery.html'} to look at the results")
    return 1 if summary.failed_items else 0


def cmd_report(args: argparse.Namespace) -> int:
    from snapref_ray.report import write_report

    result = write_report(args.output)
    print(json.dumps(result, indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="snapref-ray", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of a usage error too (also: SNAPREF_DEBUG=1)"
    )
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

    p = sub.add_parser("txt2img", help="render images from a prompt (optionally with a reference)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--out", required=True, help="output PNG path (numbered when --n > 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=1, help="images, consecutive seeds, one batch")
    p.add_argument(
        "--reference", action="append", default=[], help="reference image; repeat for several of one character"
    )
    p.add_argument("--reference2", help="second character's reference, stitched to the right of --reference")
    p.add_argument("--init-image", help="input image for img2img (use with --denoise < 1)")
    add_model_flags(p, models_required=True)
    add_settings_flags(p)
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
        "--wait-for-lease",
        type=float,
        nargs="?",
        const=600.0,
        metavar="SECONDS",
        help="if another driver is rendering to the same output, wait up to SECONDS (default 600) for it "
        "instead of refusing",
    )
    add_model_flags(p)
    add_settings_flags(p)
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
    """Run one subcommand. A usage error (a setting, file or model that does not fit) is one line on stderr
    and exit status 2; `--debug` (or SNAPREF_DEBUG=1) shows its traceback instead."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_reporting_usage_errors(lambda: args.func(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
