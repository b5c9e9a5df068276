"""`snapref-ray eval SPEC.yaml` and `snapref-ray timing SPEC.yaml | --models DIR ...`.

Registered on the main parser by `add_eval_parsers(sub)`; the work is in snapref_ray/jobs/identity_eval.py
and snapref_ray/jobs/timing_table.py.
"""

from __future__ import annotations

import argparse
import os

from snapref_ray.cli_flags import add_model_flags, model_spec_from, worker_count_overrides
from snapref_ray.model_spec import LoRASpec


def cmd_eval(args: argparse.Namespace) -> int:
    from snapref_ray.jobs.identity_eval import RESULT_JSON, run_identity_eval

    spec = eval_spec(args)
    report = run_identity_eval(spec)
    lo, hi = report["gap_ci"]
    print(
        f"{report['n_cases']} cases of {report['n_characters']} characters ({report['n_failed']} failed): "
        f"loss right {report['mean_loss_right']:.6g}, wrong {report['mean_loss_wrong']:.6g}, "
        f"gap {report['gap']:.6g} ({100 * report['ci_level']:.0f}% CI {lo:.6g} .. {hi:.6g}), "
        f"right reference wins {100 * report['right_wins_fraction']:.0f}% of cases"
    )
    print(f"wrote {spec.output.uri.rstrip('/')}/{RESULT_JSON} and heldout_loss.parquet")
    return 1 if report["n_failed"] else 0


def eval_spec(args: argparse.Namespace):
    """The evaluation spec with `--out` and `--workers` over it, validated as the fields they set."""
    from snapref_ray.jobs.identity_eval import load_eval_spec

    overrides = {"output": {"uri": args.out} if args.out else {}, "cluster": worker_count_overrides(args.workers)}
    return load_eval_spec(args.spec).with_overrides(overrides)


def _absolute(path: str | None) -> str | None:
    return None if path is None or "://" in path else os.path.abspath(os.path.expanduser(path))


def timing_spec_from_args(args: argparse.Namespace):
    """The TimingSpec of a `snapref-ray timing` command line (a spec file, then flags on top)."""
    from snapref_ray.jobs.timing_spec import TimingSpec, load_timing_spec
    from snapref_ray.model_spec import ModelSpec

    if args.spec:
        spec = load_timing_spec(args.spec)
        raw = spec.model_dump()
        model = spec.model
    elif args.model_models_dir:
        raw, model = {}, None
    else:
        raise ValueError("give a timing spec (SPEC.yaml) or --models DIR")
    model = model_spec_from(args, model).resolve_paths(os.getcwd())
    raw["model"] = ModelSpec.model_validate(model).model_dump()
    flags = {
        "reference": _absolute(args.reference),
        "width": args.width,
        "height": args.height,
        "steps": args.steps,
        "sampler": args.sampler,
        "cfg": args.cfg,
        "seed": args.seed,
        "prompt": args.prompt,
        "repetitions": args.repetitions,
        "turbo_steps": args.turbo_steps,
        "title": args.title,
        "ref_guidance": args.ref_guidance,
    }
    raw.update({k: v for k, v in flags.items() if v is not None})
    if args.turbo_lora:
        lora = LoRASpec.parse(args.turbo_lora)
        raw["turbo_lora"] = {"path": _absolute(lora.path), "strength": lora.strength}
    if args.settings:
        raw["settings"] = [s.strip() for s in args.settings.split(",") if s.strip()]
    if args.no_warmup:
        raw["warmup"] = False
    output = dict(raw.get("output") or {})
    if args.out:
        output["uri"] = _absolute(args.out)
    raw["output"] = output
    return TimingSpec.model_validate(raw)


def cmd_timing(args: argparse.Namespace) -> int:
    from snapref_ray.jobs.timing_report import format_markdown
    from snapref_ray.jobs.timing_table import RESULT_MD, run_timing

    spec = timing_spec_from_args(args)
    summary = run_timing(spec)
    print(format_markdown(summary))
    print(f"wrote {spec.output.uri.rstrip('/')}/{RESULT_MD} and comparison_summary.json")
    return 0


def add_eval_parsers(sub) -> None:
    """Register `eval` and `timing` on the `snapref-ray` subparsers."""
    p = sub.add_parser("eval", help="identity-gap evaluation of an adapter: heldout_loss.json (+ .parquet)")
    p.add_argument("spec", help="evaluation spec YAML (see snapref_ray/examples/example_eval_spec.yaml)")
    p.add_argument("--out", help="output folder or s3://bucket/prefix (overrides the spec's)")
    p.add_argument("--workers", type=int, help="workers (default: the spec's; one per GPU, else 2 CPU workers)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("timing", help="same-case timing table of each setting: comparison_summary.json + .md")
    p.add_argument("spec", nargs="?", help="timing spec YAML; or use --models for the quick form")
    p.add_argument("--reference", help="reference image (default: reference.png in --models)")
    p.add_argument("--out", help="output folder or s3://bucket/prefix (default ./output)")
    p.add_argument("--width", type=int, help="image width of the case (default: the spec's; 832)")
    p.add_argument("--height", type=int, help="image height of the case (default: the spec's; 1216)")
    p.add_argument("--steps", type=int, help="sampling steps of the case (default: the spec's; 28)")
    p.add_argument("--sampler", choices=["euler", "er_sde"], help="sampler of the case (default: the spec's; euler)")
    p.add_argument("--cfg", type=float, help="text CFG scale of the case (default: the spec's; 4.5)")
    p.add_argument("--seed", type=int, help="noise seed of the case (default: the spec's; 0)")
    p.add_argument("--prompt", help="scene prompt of the case (default: the spec's)")
    p.add_argument("--ref-guidance", type=float, help="ref_guidance of the ref-guidance rows (default 4.5)")
    p.add_argument("--repetitions", type=int, help="interleaved repetitions per setting (default 3)")
    p.add_argument("--turbo-lora", help="turbo LoRA to merge for the turbo row, PATH[:STRENGTH]")
    p.add_argument("--turbo-steps", type=int, help="steps of the turbo row (default 10)")
    p.add_argument("--settings", help="comma-separated subset of the settings (no_reference always runs)")
    p.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up run of each setting")
    add_model_flags(p)
    p.add_argument("--title", help="heading of the Markdown table")
    p.set_defaults(func=cmd_timing)
