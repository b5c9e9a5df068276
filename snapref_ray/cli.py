"""`snapref-ray ...`: the command line. Each subcommand maps its flags onto the shared models."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from snapref_ray.cli_flags import (
    HelpFormatter,
    add_model_flags,
    add_settings_flags,
    model_spec_from,
    render_spec,
    settings_from,
)
from snapref_ray.eval_cli import add_eval_parsers
from snapref_ray.jobs.job_outcome import exit_status, memory_line, not_rendered_lines, plural, summary_line
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
    from snapref_ray.render_service import RenderService
    from snapref_ray.render_service.records import encode_output
    from snapref_ray.requests import RenderRequest

    # Every flag checked before the model loads (a minute with real weights), not after.
    fmt = _format_of(Path(args.out))
    model = model_spec_from(args)
    given = settings_from(args)
    RenderRequest(prompt=args.prompt, seed=args.seed, settings=given)  # the seed and prompt, as the requests take them
    judge = _judge_call(args.judge)
    init = None
    if args.init_image:
        from PIL import Image

        init = Image.open(args.init_image)
    service = RenderService.load(model)
    settings = service.resolve(given)
    reference = _reference(args, settings, service.adapter_kind)
    requests = [RenderRequest(prompt=args.prompt, seed=args.seed + i, settings=settings) for i in range(args.n)]
    bar, update = _progress("sampling")
    with bar:
        rendered = service.render(requests, reference=reference, init_image=init, progress=update, judge=judge)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(rendered):
        path = out if len(rendered) == 1 else out.with_name(f"{out.stem}_{i:03d}{out.suffix}")
        path.write_bytes(encode_output(image, model=service.model_id, adapter=service.adapter_id, fmt=fmt))
        t = image.timings
        print(
            f"{path}  seed {image.request.seed}  sample {t['sample_s']:.2f} s  decode {t['decode_s']:.2f} s"
            + (f"  reference encode {t['encode_s']:.2f} s" if reference else "")
        )
        if image.judgement is not None:
            print(f"  judged: {_describe_judgement(image.judgement)}")
    return 0


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _judge_call(text: str | None):
    """--judge: check names (`sanity,near_duplicate`, each with its defaults) or a JSON object of settings."""
    if text is None:
        return None
    from snapref_ray.render_service.judges.call import judge_call
    from snapref_ray.render_service.judges.spec import JudgeSpec

    try:
        spec = JudgeSpec.model_validate_json(text) if text.lstrip().startswith("{") else JudgeSpec.of_names(text)
    except ValueError as e:  # pydantic's ValidationError is one
        raise ValueError(f"--judge: {e}") from None
    return judge_call(spec, lambda path: _read_file(path, "judge.identity_gap.contrast_reference"))


def _describe_judgement(judgement) -> str:
    """`accepted` or `rejected by ...`, then every score the judges recorded (name=value)."""
    verdict = "accepted" if judgement.accepted else "rejected by " + ",".join(judgement.rejected_by)
    scores = judgement.scores.model_dump(exclude_none=True)
    return verdict + "".join(f"  {k}={v:.6g}" if isinstance(v, float) else f"  {k}={v}" for k, v in scores.items())


def _reference(args: argparse.Namespace, settings: RenderSettings, adapter_kind: str | None):
    """The typed `Reference` of --reference / --reference2, checked before any device work (None without one)."""
    from snapref_ray.render_service.references import Reference, ReferenceImageError, check_reference
    from snapref_ray.requests import RenderError

    images, layout = _reference_images(args)
    if images is None:
        return None
    sources = [*args.reference, *([args.reference2] if args.reference2 else [])]
    flags = ["--reference"] * len(args.reference) + (["--reference2"] if args.reference2 else [])
    try:
        check_reference(images, layout, sources, adapter_kind)
    except ReferenceImageError as e:
        flag = flags[sources.index(e.source)] if e.source in sources else "--reference"
        if e.source is None:  # the reference as a whole, not one file
            raise ReferenceImageError(f"{flag} {e}") from None
        raise ReferenceImageError(e.reason, f"{flag} {e.source}") from None
    except RenderError as e:  # a layout the adapter does not read
        flag = "--reference2" if layout == "pair" else f"--reference (given {len(args.reference)} times)"
        raise RenderError(f"{flag}: {e.reason}", field="reference", reason=e.reason) from None
    return Reference.of_images(images, layout, settings, sources)


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


_FORMATS = {".png": "png", ".webp": "webp", ".jpg": "jpeg", ".jpeg": "jpeg"}


def _format_of(path: Path) -> str:
    """png, webp or jpeg from the output file's extension; any other is refused (a `.gif` once got PNG bytes)."""
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"--out {path}: the image formats are {', '.join(_FORMATS)} (name the file with one)")
    return fmt


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


class OutputOfAnotherJob(ValueError):
    """The output folder holds another job's images, and --append was not given (a usage error: exit status 2)."""


def cmd_render(args: argparse.Namespace) -> int:
    from snapref_ray.jobs.places import check_places

    spec = render_spec(args)
    check_places(spec, spec.manifest)  # before the dry run's reads, and before the job's log opens in the output
    if args.dry_run:
        return _dry_run(spec, allow_invalid=args.allow_invalid)
    return _run_job_from_the_command_line(
        spec, progress=_progress_bar(args), verbose=args.verbose, allow_invalid=args.allow_invalid
    )


def _dry_run(spec, *, allow_invalid: bool = False) -> int:
    """Validate, count and read the output's ledger; render nothing, write nothing. The exit status is the one the
    run would end with for its invalid rows (1 unless --allow-invalid)."""
    from snapref_ray.jobs.run_preview import check_something_to_render, preview_run

    plan = preview_run(spec)
    for line in plan.lines():
        print(f"dry run: {line}")
    check_something_to_render(spec.manifest, plan)
    if plan.owner == "another job":
        raise OutputOfAnotherJob(f"output {plan.output} belongs to another job: add --append, or choose another --out")
    if plan.invalid_rows and not allow_invalid:
        print(
            f"dry run: {plural(plan.invalid_rows, 'invalid row')} would not be rendered: fix them in the manifest, or"
            " add --allow-invalid to accept them; exit status 1"
        )
        return 1
    return 0


def _run_job_from_the_command_line(
    spec, *, progress: bool, verbose: bool, gallery_note: bool = True, allow_invalid: bool = False
) -> int:
    """run_job with job.log in the output and Ray's output kept off the terminal; the summary lines; the exit
    status (jobs/job_outcome.py): 0 when every row is in the output, 1 when rows were left out (failed items, or
    invalid rows unless `allow_invalid`), each of the first few named, with where the rest are."""
    from snapref_ray.job_console import job_console
    from snapref_ray.jobs.generate_dataset import run_job
    from snapref_ray.storage.ledger import OutputConflictError

    with job_console(spec.output.uri, s3=spec.s3_options(), progress=progress, verbose=verbose) as log_file:
        try:
            summary = run_job(spec, progress=progress)
        except OutputConflictError as e:  # a usage error: one line that names the flag
            raise OutputOfAnotherJob(
                str(e).replace("pass append=True", "add --append (output.append: true in a spec)")
            ) from None
    print(summary_line(summary))
    memory = memory_line(summary)
    if memory:
        print(memory)
    if gallery_note:
        print(f"gallery: {_join(spec.output.uri, 'gallery.html')}; log: {log_file}")
    errors_at = f"{_join(spec.output.uri, 'errors')}/ and {_join(spec.output.uri, 'errors.html')}"
    for line in not_rendered_lines(summary, errors_at=errors_at, allow_invalid=allow_invalid):
        print(line)
    return exit_status(summary, allow_invalid=allow_invalid)


def _join(uri: str, name: str) -> str:
    return uri.rstrip("/") + "/" + name if uri.startswith("s3://") else str(Path(uri).resolve() / name)


def _add_progress_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress bar, or (--no-progress) log lines on the terminal as in job.log (default: the bar when"
        " stderr is a terminal; a log file or a CI log gets the lines)",
    )


def _progress_bar(args: argparse.Namespace) -> bool:
    """The bar where a person watches it: redrawn with carriage returns, it only reads well on a terminal."""
    return args.progress if args.progress is not None else sys.stderr.isatty()


def cmd_demo(args: argparse.Namespace) -> int:
    from snapref_ray.job_spec import load_job_spec

    out = Path(args.out).resolve()
    # Beside the output, not inside it: the output is the dataset, and `make-tiny tiny` (the README's next step)
    # writes the same files to the same default folder.
    from snapref_ray.storage.backends import check_local_folder

    models = Path(args.models).resolve()
    check_local_folder(str(out))
    check_local_folder(str(models), "models folder")
    if not (models / "dit.safetensors").exists():
        from snapref_ray.tiny import make_tiny  # torch: only where the tiny models are made

        make_tiny(models)
    spec = load_job_spec(str(Path(__file__).parent / "examples" / "example_spec.yaml"))
    spec = spec.with_overrides({"model": {"models_dir": str(models)}, "output": {"uri": str(out)}})
    status = _run_job_from_the_command_line(
        spec, progress=_progress_bar(args), verbose=args.verbose, gallery_note=False
    )
    print(f"open {out / 'gallery.html'} to look at the results")
    return status


def cmd_report(args: argparse.Namespace) -> int:
    from snapref_ray.report import write_report

    result = write_report(args.output)  # refuses, in one line, a place that holds no job output (report/report.py)
    print(json.dumps(result, indent=2, default=str))
    return 0


RENDER_EXAMPLES = """examples:
  snapref-ray make-tiny tiny
  snapref-ray render snapref_ray/examples/example_manifest.csv --models tiny --out out/run1 \\
      --width 256 --height 256 --steps 4                                    # README's job: the same output
  snapref-ray render manifest.csv --models tiny --out out/run1 --dry-run    # validate and count, render nothing
  snapref-ray render more.csv --models tiny --out out/run1 --append         # add another job's images to run1
  snapref-ray render job.yaml                                               # a job spec (docs/jobs.md)

exit status: 0 every row rendered (or already there; with --allow-invalid, every valid row); 1 rows left out:
failed items (run it again to retry them) or invalid rows (the first few are named; errors/ has them all);
2 a usage error or input that renders nothing (every row invalid, --strict and an invalid row, an output of
another job, a worker no node can hold); 130 interrupted (Ctrl-C: what was committed stays, run the same
command again to resume)."""


class _Parser(argparse.ArgumentParser):
    """Every (sub)command's help shows the flags' defaults and keeps the examples' line breaks; a flag it does not
    know is refused by the subcommand that was given, with the closest of that subcommand's own flags."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        namespace, unknown = self.parse_known_args(args, namespace)
        if unknown:
            parser = _chosen_subparser(self, namespace)
            parser.error(f"unrecognized arguments: {' '.join(unknown)}{_did_you_mean(unknown, parser)}")
        return namespace


def _chosen_subparser(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)command parser the arguments chose (`snapref-ray adapter inspect` -> inspect's)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(namespace, action.dest, None) or "")
            if chosen is not None:
                return _chosen_subparser(chosen, namespace)
    return parser


def _did_you_mean(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """` (did you mean --steps?)` for the first unknown flag close to one of `parser`'s own (argparse in Python
    3.11 has no such hint), else ""."""
    import difflib

    flags = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    for arg in unknown:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.7)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from snapref_ray import __version__

    found = []
    for name in ("ray", "torch"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            continue
    return f"snapref-ray {__version__} ({', '.join(found)}; Python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="snapref-ray", description=__doc__)
    parser.add_argument("--version", action="version", version=_version(), help="print the versions and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of a usage error too (also: SNAPREF_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("make-tiny", help="write a tiny random-weight model set (real file layouts) for tests and demos")
    p.add_argument("dir", help="the folder to write (created)")
    p.add_argument("--blocks", type=int, default=2, help="transformer blocks of the tiny DiT")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument(
        "--adapter-kind",
        choices=("snapref", "arcanima-v2", "arcanima-pilot"),
        default="snapref",
        help="which kind of reference adapter adapter.safetensors is",
    )
    p.set_defaults(func=cmd_make_tiny)

    p = sub.add_parser("txt2img", help="render images from a prompt (optionally with a reference)")
    p.add_argument("--prompt", required=True, help="the scene prompt")
    p.add_argument("--out", required=True, help="output image: .png, .webp or .jpg (numbered when --n > 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first image")
    p.add_argument("--n", type=_at_least_one, default=1, help="images, consecutive seeds, one batch")
    p.add_argument(
        "--reference", action="append", default=[], help="reference image; repeat for several of one character"
    )
    p.add_argument("--reference2", help="second character's reference, stitched to the right of --reference")
    p.add_argument("--init-image", help="input image for img2img (use with --denoise < 1)")
    p.add_argument(
        "--judge",
        help="judge each image and print its scores: check names (sanity,near_duplicate,identity_gap,embedding:"
        " their defaults) or a JSON object of their settings (docs/judging.md)",
    )
    add_model_flags(p, models_required=True)
    add_settings_flags(p)
    p.set_defaults(func=cmd_txt2img)

    p = sub.add_parser("adapter", help="reference adapter files (SnapRef, ArcAnima v2 and pilot)")
    adapter_sub = p.add_subparsers(dest="adapter_command", required=True, metavar="COMMAND")
    q = adapter_sub.add_parser(
        "inspect",
        help="what a file is and why: kind, rank, blocks, linears, dtype,"
        " parameters, the method it implies (also for files it cannot use)",
    )
    q.add_argument("file", help="the .safetensors file")
    q.add_argument("--json", action="store_true", help="print the result as JSON")
    q.set_defaults(func=cmd_adapter_inspect)
    q = adapter_sub.add_parser("convert", help="rename the tensors of a file (and set its kind) with a YAML map")
    q.add_argument("input", help="the .safetensors file to read")
    q.add_argument("output", help="the .safetensors file to write")
    q.add_argument("--map", required=True, help="YAML: rename [[PATTERN, REPLACEMENT], ...], drop, kind, metadata")
    q.set_defaults(func=cmd_adapter_convert)

    p = sub.add_parser(
        "render",
        help="run a batch job: a job spec (SPEC.yaml), or a manifest with --models DIR --out DIR",
        description="Run (or resume) a batch job: every row of the manifest rendered once into the output, with"
        " Parquet metadata, errors/, summary.json, gallery.html and job.log. Running it again resumes it. Over a"
        " spec file, every flag given sets its field (--steps the rows' default, --workers the cluster's),"
        " validated as the field is.",
        epilog=RENDER_EXAMPLES,
    )
    p.add_argument(
        "spec_or_manifest", help="job spec (.yaml) or manifest (.csv/.jsonl/.parquet; columns reference, prompt)"
    )
    p.add_argument("--out", help="output folder or s3://bucket/prefix (default: the spec's output.uri)")
    p.add_argument("--workers", type=int, help="exactly N render workers (default: --min-workers/--max-workers)")
    p.add_argument("--min-workers", type=int, help="start rendering once N workers are ready (default 1)")
    p.add_argument(
        "--max-workers",
        type=int,
        help="grow the pool up to N workers as the autoscaler adds GPU nodes (default: the GPUs present "
        "at start, or 2 CPU workers on a machine without GPUs)",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="add this job's images to an output that holds another job's (else that is refused)",
    )
    p.add_argument(
        "--rerender-changed",
        action="store_true",
        help="render again the rows whose explicit id the output holds with other content (else refused)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the manifest, count items, invalid rows and what the output already holds; render nothing",
    )
    p.add_argument(
        "--strict", action="store_true", help="refuse to start when any row is invalid (exit 2; `strict: true`)"
    )
    p.add_argument(
        "--allow-invalid",
        action="store_true",
        help="exit 0 when every valid row is rendered: the invalid rows are accepted (else they make it exit 1)",
    )
    p.add_argument(
        "--wait-for-lease",
        type=float,
        nargs="?",
        const=600.0,
        metavar="SECONDS",
        help="if another driver is rendering to the same output, wait up to SECONDS (default 600) for it "
        "instead of refusing",
    )
    p.add_argument(
        "--judge",
        dest="job_judge",
        metavar="CHECKS",
        help="judge every render (check names with their defaults: sanity,near_duplicate,identity_gap) and render"
        " the rejected ones again; over a spec file, the checks that run, each with the settings of the spec's"
        " judge: section (docs/judging.md)",
    )
    p.add_argument("--max-renders-per-item", type=int, help="with --judge: renders an item gets at most (default 3)")
    p.add_argument("--kept-per-reference", type=int, help="with --judge: images kept per reference at most")
    _add_progress_flag(p)
    add_model_flags(p)
    add_settings_flags(p)
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("demo", help="make the tiny models and render the bundled example on a local Ray")
    p.add_argument("--out", default="demo-output", help="output folder")
    p.add_argument("--models", default="tiny", help="the tiny models' folder (made there when it holds none)")
    _add_progress_flag(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("report", help="regenerate gallery.html and the throughput plots of a job's output")
    p.add_argument("output", help="the job's output folder or s3://bucket/prefix")
    p.set_defaults(func=cmd_report)

    add_serve_parser(sub)
    add_eval_parsers(sub)
    return parser


INTERRUPTED = 130  # what a shell reports for a command ended by SIGINT (128 + 2)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. A usage error (a setting, file or model that does not fit, input that renders nothing)
    is one line on stderr and exit status 2; `--debug` (or SNAPREF_DEBUG=1) shows its traceback instead. Ctrl-C is
    one line and exit status 130."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ray_before = _ray_connected()
    try:
        try:
            return run_reporting_usage_errors(lambda: args.func(args), debug=args.debug)
        finally:
            if not ray_before and _ray_connected():
                # The local Ray this command started stops here, where a Ctrl-C during its shutdown is still ours
                # (Ray's own atexit shutdown would print a KeyboardInterrupt traceback instead).
                sys.modules["ray"].shutdown()
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("interrupted: what was committed stays; run the same command again to resume", file=sys.stderr)
        return INTERRUPTED


def _ray_connected() -> bool:
    """Whether this process is connected to a Ray (without importing Ray for the commands that never use it)."""
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


if __name__ == "__main__":
    sys.exit(main())
