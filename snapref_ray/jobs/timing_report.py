"""The timing table's figures and its Markdown: medians of the measured runs, ratios against the no-reference
row, the FLOP model's ratios beside them, and comparison_summary.md.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from snapref_ray.jobs.timing_settings import TimingSetting
from snapref_ray.jobs.timing_spec import TimingSpec


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def table_rows(settings: list[TimingSetting], runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for s in settings:
        measured = runs[s.name]
        per_image = _median([m["seconds_per_image"] for m in measured])
        per_step = _median([m["sample_s"] / m["steps"] for m in measured])
        rows.append(
            {
                "name": s.name,
                "label": s.label,
                "reference": s.reference,
                "turbo_lora_merged": s.turbo,
                "settings": s.settings.model_dump(mode="json"),
                "seconds_per_image": per_image,
                "seconds_per_step": per_step,
                "encode_seconds": _median([m["encode_s"] for m in measured]),
                "cpu_seconds_per_step": _median([m["cpu_seconds_per_step"] for m in measured]),
                "refkv_bytes": measured[0]["refkv_bytes"],
                # The step cache's forwards saved (its images' rows skip or run together); None without it.
                "skipped_forwards": measured[0]["skipped_forwards"],
                "peak_memory_bytes": max(m["peak_memory_bytes"] for m in measured),
                "runs": measured,
            }
        )
    base = next(r for r in rows if r["name"] == "no_reference")
    for r in rows:
        r["ratio_to_no_reference"] = r["seconds_per_image"] / base["seconds_per_image"]
        r["step_ratio_to_no_reference"] = r["seconds_per_step"] / base["seconds_per_step"]
        r["cpu_step_ratio_to_no_reference"] = (
            r["cpu_seconds_per_step"] / base["cpu_seconds_per_step"]
            if r["cpu_seconds_per_step"] and base["cpu_seconds_per_step"]
            else None
        )
    return rows


def add_flop_ratios(rows: list[dict], settings: list[TimingSetting], spec: TimingSpec) -> None:
    """Each row's FLOP-model step ratio at 832x1216 (real Anima, 1 MP reference) beside the measured one."""
    from snapref_ray.adapter.controls import resolve_settings
    from snapref_ray.jobs.flop_model import real_size_ratios
    from snapref_ray.sampling.ref_guidance import step_rows
    from snapref_ray.sampling.schedules import get_sigmas

    shares = {}
    for s in settings:
        resolved = resolve_settings(s.settings, s.adapter_kind or "snapref")
        sigmas = get_sigmas("simple", resolved.steps)[:-1]
        active = [step_rows(resolved, float(sig), s.reference).ref_guidance_active for sig in sigmas]
        shares[s.name] = sum(active) / len(active)
    ratios = real_size_ratios(shares, steps=spec.steps, cfg=spec.cfg != 1.0)
    for r in rows:
        r["flop_step_ratio_832x1216"] = ratios[r["name"]]
        r["ref_guidance_step_share"] = shares[r["name"]]


def default_title(env: dict) -> str:
    m = env["model"]
    where = "GPU" if env["device"].startswith("cuda") else "CPU"
    return (
        f"SnapRef timing table: {where} figures, {env['device_name']}, {env['dtype']}, "
        f"DiT {m['model_channels']} wide x {m['num_blocks']} blocks"
    )


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def format_markdown(summary: dict) -> str:
    """The Markdown table of a comparison_summary.json (what comparison_summary.md holds)."""
    env, case = summary["environment"], summary["case"]
    cpu = not env["device"].startswith("cuda")
    memory = "peak RSS delta (CPU)" if cpu else "peak GPU memory"
    lines = [f"# {summary['title']}", ""]
    if cpu:
        lines += [
            "**CPU figures** on the models named below (tiny or width-scaled random weights when run from "
            "`snapref-ray make-tiny`), not GPU numbers: per-call overheads weigh far more than on a GPU, "
            "so read the ratios, not the seconds.",
            "",
        ]
    m = env["model"]
    lines += [
        f"- device: {env['device']} ({env['device_name']}), dtype {env['dtype']}, torch threads: "
        f"{env['torch_threads']}; torch {env['torch']}, ray {env['ray']}, snapref-ray {env['snapref_ray']}, "
        f"python {env['python']}",
        f"- model: {m['id']} ({m['model_channels']} channels, {m['num_blocks']} blocks, {m['num_heads']} heads x "
        f"{m['head_dim']}); adapter {str(env['adapter'])[:19]}",
        f"- case: {case['width']}x{case['height']}, {case['steps']} steps, {case['sampler']}/{case['scheduler']}, "
        f"cfg {case['cfg']:g}, seed {case['seed']}; reference {Path(case['reference']).name} "
        f"({case['reference_size'][0]}x{case['reference_size'][1]})",
        f"- {summary['statistic']} of {summary['repetitions']} interleaved repetitions"
        + (" after one unmeasured warm-up run of each setting" if summary["warmup"] else ""),
        f"- memory: {summary['memory_metric']}",
        "",
        f"| setting | s/image | s/step | x no ref (image) | x no ref (step) | {memory} | RefKV | encode s |"
        + (" CPU s/step | x no ref (CPU time, step) |" if cpu else "")
        + " FLOP model x no ref (step, 832x1216) | forwards skipped |",
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if cpu else "") + "---:|---:|",
    ]
    for r in summary["settings"]:
        line = (
            f"| {r['label']} | {_seconds(r['seconds_per_image'])} | {_seconds(r['seconds_per_step'])} | "
            f"{r['ratio_to_no_reference']:.2f} | {r['step_ratio_to_no_reference']:.2f} | "
            f"{_bytes(r['peak_memory_bytes'])} | {_bytes(r['refkv_bytes'])} | {_seconds(r['encode_seconds'])} |"
        )
        if cpu:
            ratio = r["cpu_step_ratio_to_no_reference"]
            line += f" {_seconds(r['cpu_seconds_per_step'])} | {'-' if ratio is None else f'{ratio:.2f}'} |"
        flop = r.get("flop_step_ratio_832x1216")
        line += f" {'-' if flop is None else f'{flop:.2f}'} |"
        skipped = r.get("skipped_forwards")
        line += " - |" if skipped is None else f" {skipped}/{case['steps']} |"
        lines.append(line)
    lines += [
        "",
        "s/image: one `Renderer.render` call (text encoding, sampling, VAE decode) with the reference already "
        "encoded, as every image after the first of a reference costs in a batch job; the one-off encode "
        "(VAE + caption + reference stream) is the last column. The recompute baseline has no cache: its s/image "
        "includes preparing the reference, and its reference stream runs inside every step. "
        "s/step: the sampling loop only, divided by the steps. x no ref: the medians divided by the no-reference "
        "row's (the turbo row against the full-step no-reference row). FLOP model: matmul FLOPs of one step "
        "of real Anima at 832x1216 with a 1 MP reference (`snapref_ray/jobs/flop_model.py`), against the "
        "no-reference step; a floor that leaves out memory traffic. ArcAnima rows run their own adapter file "
        "(the pilot's RefKV column is its reference latent: nothing else is cached). "
        "forwards skipped: of the image's sampling steps, how many DiT forwards the step cache let it skip "
        "(its FLOP column is per forward it runs).",
        "",
    ]
    if cpu:
        lines += [
            "CPU s/step: process CPU time (all threads) per sampling step, from the steps' progress callbacks "
            "(steps 2..n). On a shared machine wall-clock seconds move with other processes' load; CPU time counts "
            "only this process's work, so its ratio is the stable one there.",
            "",
        ]
    for name, why in summary.get("left_out", {}).items():
        lines.append(f"- left out: {name}, {why}")
    return "\n".join(lines)
