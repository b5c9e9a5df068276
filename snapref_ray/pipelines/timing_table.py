"""The side-by-side timing table as a Ray job: comparison_summary.json + comparison_summary.md out.

One case (size, steps, sampler, prompt, seed, reference) rendered under each setting on one Ray
actor that owns a render service per model (the service every front door renders through);
settings are measured interleaved (every repetition runs each setting once, in alternating order)
so drift in clocks or load spreads over all of them, and the table reports medians. Ratios are
computed from those medians against the no-reference row.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from PIL import Image
from pydantic import Field, field_validator

from snapref_ray.model_spec import LoRASpec, ModelSpec
from snapref_ray.platform_info import cpu_model
from snapref_ray.requests import RenderSettings, Sampler, StepCache
from snapref_ray.storage.backends import S3Options, open_storage, read_uri
from snapref_ray.storage.jobspec import ClusterSpec, OutputSpec, SpecFile, load_spec_file
from snapref_ray.validation import run_reporting_usage_errors

log = logging.getLogger(__name__)

RESULT_JSON = "comparison_summary.json"
RESULT_MD = "comparison_summary.md"
FORMAT = "snapref-ray/comparison_summary/1"
SETTING_NAMES = (
    "no_reference",
    "snapref_default",
    "ref_in_uncond",
    "ref_guidance_apg",
    "ref_end_0.6",
    "recompute_every_step",
    "turbo",
    "step_cache",
    "arcanima_v2",
    "arcanima_v2_rg1",
    "arcanima_pilot",
    "arcanima_pilot_rg1",
)
ARCANIMA_ROWS = {
    "arcanima_v2": "arcanima-v2",
    "arcanima_v2_rg1": "arcanima-v2",
    "arcanima_pilot": "arcanima-pilot",
    "arcanima_pilot_rg1": "arcanima-pilot",
}


class TimingSpec(SpecFile):
    """One timing case and the settings to compare on it."""

    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("arcanima_v2_adapter", "arcanima_pilot_adapter", "reference")

    model: ModelSpec = Field(
        ..., description="The model and the SnapRef adapter of the SnapRef rows (as in a batch job spec)."
    )
    arcanima_v2_adapter: str | None = Field(
        None,
        description="ArcAnima v2 file for the arcanima_v2 rows; None = arcanima-v2.safetensors in models_dir "
        "if there is one (else those rows are left out, and the table says so).",
    )
    arcanima_pilot_adapter: str | None = Field(
        None,
        description="ArcAnima pilot file for the arcanima_pilot rows; None = arcanima-pilot.safetensors in "
        "models_dir if there is one.",
    )
    reference: str | None = Field(
        None, description="Reference image; None = reference.png in models_dir (the tiny model set has one)."
    )
    prompt: str = Field(
        "1girl, solo, cowboy shot, sitting, cafe, holding cup, smile, looking at viewer, window, day",
        description="Scene prompt of the case; its content does not change the cost.",
    )
    negative_prompt: str = Field("", description="Negative prompt; empty as Anima's ComfyUI default.")
    width: int = Field(832, description="Image width; 832x1216 is the size of the published GPU step times.")
    height: int = Field(1216, description="Image height.")
    steps: int = Field(28, ge=1, le=1000, description="Steps; 28, the step count of the published comparison.")
    sampler: Sampler = Field("euler", description="euler: deterministic (no step noise) and one model call per step.")
    cfg: float = Field(4.5, ge=0.0, description="Text CFG; 4.5 as SnapRef recommends (so the uncond row runs).")
    seed: int = Field(0, ge=0, description="Noise seed; the same for every setting.")
    ref_guidance: float = Field(
        4.5,
        description="ref_guidance of the ref-guidance settings; 4.5 as the ArcAnima "
        "table uses (any value != 1 costs the same).",
    )
    ref_end: float = Field(
        0.6,
        ge=0.0,
        le=1.0,
        description="ref_end of the early-stop setting; ~0.6 is the suggested saving with nearly the same image.",
    )
    turbo_lora: LoRASpec | None = Field(
        None,
        description="Turbo LoRA merged for the turbo row; None = the turbo "
        "sampling settings on the base model (said in the table).",
    )
    turbo_steps: int = Field(10, ge=1, description="Steps of the turbo row; 10 as the ArcAnima turbo row.")
    settings: list[str] = Field(
        list(SETTING_NAMES),
        description="Which settings to run; no_reference is always run (the ratios are against it).",
    )
    repetitions: int = Field(
        3, ge=1, le=100, description="Interleaved repetitions per setting; the median of 3 rejects one outlier."
    )
    warmup: bool = Field(True, description="Run each setting once unmeasured first (allocator, kernel selection).")
    title: str | None = Field(None, description="Heading of the Markdown table; default says device and model.")
    output: OutputSpec = Field(default_factory=OutputSpec, description="Where comparison_summary.* go.")
    cluster: ClusterSpec = Field(
        default_factory=ClusterSpec,
        description="Ray address, device and dtype (one actor; num_cpus_per_worker applies).",
    )

    @field_validator("settings")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        unknown = [name for name in v if name not in SETTING_NAMES]
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(SETTING_NAMES)}")
        return v

    def s3_options(self) -> S3Options:
        return self.output.s3.options()

    def arcanima_adapters(self, model_adapter_kind: str | None = None) -> dict[str, str]:
        """kind -> local file of the ArcAnima rows that can run (given, found in models_dir, or the model's
        own adapter when it is of that kind)."""
        found = {}
        if model_adapter_kind in ("arcanima-v2", "arcanima-pilot") and self.model.adapter is not None:
            found[model_adapter_kind] = self.model.adapter
        for kind, given in (("arcanima-v2", self.arcanima_v2_adapter), ("arcanima-pilot", self.arcanima_pilot_adapter)):
            if given is not None:
                found[kind] = given
            elif (
                self.model.models_dir is not None
                and not self.model.models_dir.startswith("s3://")
                and (Path(self.model.models_dir) / f"{kind}.safetensors").is_file()
            ):
                found[kind] = str(Path(self.model.models_dir) / f"{kind}.safetensors")
        return found

    def reference_uri(self) -> str:
        if self.reference is not None:
            return self.reference
        if self.model.models_dir is None:
            raise ValueError("give `reference:` (no models_dir to take reference.png from)")
        return self.model.models_dir.rstrip("/") + "/reference.png"


def load_timing_spec(path_or_uri: str, s3: S3Options | None = None) -> TimingSpec:
    """Load a timing spec YAML; relative paths resolve against its folder."""
    return load_spec_file(path_or_uri, TimingSpec, s3, what="timing spec")


# ---------------------------------------------------------------------------------------------
# Settings


@dataclass(frozen=True)
class TimingSetting:
    name: str
    label: str
    settings: RenderSettings
    reference: bool
    turbo: bool = False
    adapter_kind: str | None = None  # an ArcAnima row: which extra adapter renders it


def timing_settings(spec: TimingSpec, adapter_kind: str | None = "snapref") -> list[TimingSetting]:
    """The settings of the table that can run, in table order (no_reference first); see `timing_plan`."""
    return timing_plan(spec, adapter_kind)[0]


def timing_plan(spec: TimingSpec, adapter_kind: str | None = "snapref") -> tuple[list[TimingSetting], dict[str, str]]:
    """(the settings of the table that can run, in table order; the asked-for ones left out -> why).

    `adapter_kind` is the kind of `model.adapter` (or the models folder's adapter): SnapRef rows need a
    SnapRef file, an ArcAnima row the file of its kind (given as arcanima_*_adapter, found in the models
    folder, or the model's own adapter when it is of that kind).
    """
    base = RenderSettings(
        negative_prompt=spec.negative_prompt,
        width=spec.width,
        height=spec.height,
        steps=spec.steps,
        cfg=spec.cfg,
        sampler=spec.sampler,
    )
    guided = dict(ref_guidance=spec.ref_guidance, correction="apg")
    if spec.turbo_lora is not None:
        turbo_label = (
            f"turbo: LoRA {Path(spec.turbo_lora.path).name} x{spec.turbo_lora.strength:g} merged, "
            f"{_steps(spec.turbo_steps)}, cfg 1"
        )
    else:
        turbo_label = f"turbo settings ({_steps(spec.turbo_steps)}, cfg 1) on the base model: no turbo LoRA given"
    every = [
        TimingSetting("no_reference", "no reference (plain Anima)", base, False),
        TimingSetting("snapref_default", "SnapRef default (cond row reads the cached reference)", base, True),
        TimingSetting(
            "ref_in_uncond",
            "ref_in_uncond (both CFG rows read it)",
            base.model_copy(update={"ref_in_uncond": True}),
            True,
        ),
        TimingSetting(
            "ref_guidance_apg",
            f"ref_guidance {spec.ref_guidance:g} + APG (third row)",
            base.model_copy(update=guided),
            True,
        ),
        TimingSetting(
            "ref_end_0.6",
            f"ref_guidance {spec.ref_guidance:g} + APG, ref_end {spec.ref_end:g}",
            base.model_copy(update={**guided, "ref_end": spec.ref_end}),
            True,
        ),
        TimingSetting(
            "recompute_every_step",
            "recompute the reference every step (pilot-style baseline)",
            base.model_copy(update={"recompute_reference_every_step": True}),
            True,
        ),
        TimingSetting(
            "turbo",
            turbo_label,
            base.model_copy(update={"steps": spec.turbo_steps, "cfg": 1.0}),
            True,
            turbo=spec.turbo_lora is not None,
        ),
        TimingSetting(
            "step_cache",
            "SnapRef default + step cache at ComfyUI's EasyCache defaults (threshold 0.2, 0.15-0.95), per image",
            base.model_copy(update={"step_cache": StepCache()}),
            True,
        ),
        # ArcAnima at its own defaults (ref_guidance 4.5 + APG, both CFG rows read), and at ref_guidance 1
        # (no extra call), the setting of the published per-step GPU times.
        TimingSetting(
            "arcanima_v2",
            "ArcAnima v2 at its defaults (ref_guidance 4.5 + APG, both CFG rows read the cached reference)",
            base,
            True,
            adapter_kind="arcanima-v2",
        ),
        TimingSetting(
            "arcanima_v2_rg1",
            "ArcAnima v2, ref_guidance 1 (no extra call)",
            base.model_copy(update={"ref_guidance": 1.0}),
            True,
            adapter_kind="arcanima-v2",
        ),
        TimingSetting(
            "arcanima_pilot",
            "ArcAnima pilot at its defaults (reference as a second frame, recomputed"
            " every step; ref_guidance 4.5 + APG)",
            base,
            True,
            adapter_kind="arcanima-pilot",
        ),
        TimingSetting(
            "arcanima_pilot_rg1",
            "ArcAnima pilot, ref_guidance 1 (no extra call)",
            base.model_copy(update={"ref_guidance": 1.0}),
            True,
            adapter_kind="arcanima-pilot",
        ),
    ]
    available = spec.arcanima_adapters(adapter_kind)
    wanted = set(spec.settings) | {"no_reference"}
    chosen, left_out = [], {}
    for s in every:
        if s.name not in wanted:
            continue
        RenderSettings(**s.settings.model_dump())  # re-validate: model_copy does not run validators
        if s.adapter_kind is not None and s.adapter_kind not in available:
            left_out[s.name] = (
                f"needs an {s.adapter_kind} file (arcanima_{s.adapter_kind[9:]}_adapter, or"
                f" {s.adapter_kind}.safetensors in the models folder)"
            )
        elif s.adapter_kind is None and s.reference and adapter_kind != "snapref":
            left_out[s.name] = (
                "a SnapRef row: the model has no reference adapter"
                if adapter_kind is None
                else f"a SnapRef row: the model's adapter is an {adapter_kind} file"
            )
        else:
            chosen.append(s)
    return chosen, left_out


def _steps(n: int) -> str:
    return f"{n} step" + ("" if n == 1 else "s")


# ---------------------------------------------------------------------------------------------
# Measuring (inside the actor)


class PeakMemory:
    """Peak memory of a block: CUDA max_memory_allocated, else the process's peak RSS (service/memory.py).

    `peak` is what the table shows: on CUDA the absolute peak (weights included), on CPU the peak
    RSS above the RSS at the start of the block (weights are already resident there).
    """

    def __init__(self, device) -> None:
        import torch

        from snapref_ray.service.memory import CudaMemory, HostMemory

        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.memory = CudaMemory(device) if self.cuda else HostMemory()
        self.metric = (
            "cuda max_memory_allocated (absolute, weights included)"
            if self.cuda
            else "peak RSS above the start of the run (CPU, Linux VmHWM)"
        )
        self.peak = 0
        self.delta = 0

    def measure(self, fn):
        """fn's result; `peak` and `delta` set from its run."""
        import torch

        result, self.delta = self.memory.measure(fn)
        self.peak = int(torch.cuda.max_memory_allocated(self.device)) if self.cuda else self.delta
        return result


class TimingWorker:
    """A Ray actor owning a render service per model it times (base, turbo LoRA, each ArcAnima adapter).

    Every measurement renders through the service, as every front door does (its settings resolved, its
    reference read as the service decides), with a RefKV cache of 0 bytes: each repetition encodes the
    reference again, so the encode time is measured as often as the render.
    """

    def __init__(
        self,
        model: ModelSpec,
        turbo_model: ModelSpec | None = None,
        arcanima_adapters: dict[str, str] | None = None,
        s3: S3Options | None = None,
    ) -> None:
        from snapref_ray.service.loading import load_renderer
        from snapref_ray.service.service import RenderService

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        base = load_renderer(model, s3=s3)
        self.base = RenderService(base, refkv_cache_bytes=0, model_spec=model)
        self.turbo = (
            RenderService(load_renderer(turbo_model, s3=s3), refkv_cache_bytes=0, model_spec=turbo_model)
            if turbo_model is not None
            else None
        )
        # ArcAnima rows share the base renderer's model weights, with their own adapter bound.
        self.arcanima = {
            kind: RenderService(base.with_adapter(path), refkv_cache_bytes=0)
            for kind, path in (arcanima_adapters or {}).items()
        }

    def environment(self) -> dict:
        """Device, dtype, versions and model identity: what the numbers were measured on."""
        import ray
        import torch

        import snapref_ray

        r = self.base.renderer
        device = torch.device(r.device)
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
        else:
            name = cpu_model()
        cfg = r.dit.config
        return {
            "device": str(device),
            "device_name": name,
            "dtype": str(r.dtype).removeprefix("torch."),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "ray": ray.__version__,
            "snapref_ray": snapref_ray.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "model": {
                "id": r.model_id,
                "dit": str(r.files.dit),
                "model_channels": cfg.model_channels,
                "num_blocks": cfg.num_blocks,
                "num_heads": cfg.num_heads,
                "head_dim": cfg.head_dim,
            },
            "adapter": r.adapter.identity if r.adapter is not None else None,
            "arcanima_adapters": {kind: a.adapter_id for kind, a in self.arcanima.items()},
            "turbo_model": self.turbo.model_id if self.turbo is not None else None,
        }

    def measure(self, setting: TimingSetting, prompt: str, seed: int, reference: bytes | None) -> dict:
        """One image under `setting`: wall times, per-step time, encode time, RefKV bytes, peak memory."""
        import torch

        from snapref_ray.requests import RenderRequest
        from snapref_ray.service.references import Reference

        service = self.turbo if setting.turbo and self.turbo is not None else self.base
        if setting.adapter_kind is not None:
            service = self.arcanima[setting.adapter_kind]
        device = service.renderer.device
        s = setting.settings
        ref = Reference.of_images([reference], "single", s, ["reference"]) if setting.reference else None
        sync = (lambda: torch.cuda.synchronize(device)) if torch.device(device).type == "cuda" else (lambda: None)
        memory = PeakMemory(device)
        step_cpu: list[float] = []  # process CPU time after each step (progress callback)

        def run() -> tuple:
            # The service decides what the render reads: a RefKV encoded now (the cache keeps nothing), or
            # with recompute_reference_every_step the images, which the engine prepares inside the render.
            sync()
            read = service.read_reference(ref, s) if ref is not None else None
            sync()
            t0, cpu0 = time.perf_counter(), time.process_time()
            result = service.render(
                [RenderRequest(prompt=prompt, seed=seed, settings=s)],
                reference=read,
                progress=lambda i, n: step_cpu.append(time.process_time()),
            )[0]
            sync()
            return read, result, time.perf_counter() - t0, time.process_time() - cpu0

        read, result, wall, cpu = memory.measure(run)
        t = result.timings
        kv = read.refkv if read is not None else None
        cpu_step = (step_cpu[-1] - step_cpu[0]) / (len(step_cpu) - 1) if len(step_cpu) > 1 else None
        on_cpu = torch.device(device).type == "cpu"
        return {
            "seconds_per_image": wall,
            "sample_s": t["sample_s"],
            "text_s": t["text_s"],
            "decode_s": t["decode_s"],
            # The reference's preparation inside the render (the recompute row; 0 when it reads a RefKV).
            "prepare_s": t.get("encode_s", 0.0) - (read.encode_s if read is not None else 0.0),
            "steps": s.steps,
            "encode_s": read.encode_s if kv is not None else None,
            "cpu_seconds_per_image": cpu if on_cpu else None,
            "cpu_seconds_per_step": cpu_step if on_cpu else None,
            "refkv_bytes": kv.nbytes if kv is not None else None,
            "skipped_forwards": result.skipped_forwards,
            "peak_memory_bytes": memory.peak,
            "peak_memory_delta_bytes": memory.delta,
            "memory_metric": memory.metric,
        }


# ---------------------------------------------------------------------------------------------
# The job


def run_timing(spec: TimingSpec) -> dict:
    """Measure every setting on one Ray actor; writes comparison_summary.json/.md and returns the JSON."""
    import ray

    from snapref_ray.cluster.pool import connect
    from snapref_ray.service.loading import adapter_file, adapter_kind

    t_start = time.time()
    s3 = spec.s3_options()
    storage = open_storage(spec.output.uri, s3)
    kind = adapter_kind(spec.model, s3=s3)
    if kind is not None and spec.model.adapter is None:  # the models folder's adapter: name it, its rows use it
        spec = spec.model_copy(
            update={"model": spec.model.model_copy(update={"adapter": str(adapter_file(spec.model, s3=s3))})}
        )
    settings, left_out = timing_plan(spec, kind)
    for name, why in left_out.items():
        log.warning("timing row %s left out: %s", name, why)
    reference_uri = spec.reference_uri()
    reference = read_uri(reference_uri, s3)
    c = spec.cluster
    turbo_model = None
    if spec.turbo_lora is not None and any(s.turbo for s in settings):
        turbo_model = spec.model.model_copy(update={"loras": (*spec.model.loras, spec.turbo_lora)})
    connect(c.address)
    use_gpu = int(ray.cluster_resources().get("GPU", 0)) > 0 and spec.model.device != "cpu"
    actor = (
        ray.remote(TimingWorker)
        .options(num_gpus=1 if use_gpu else 0, num_cpus=c.num_cpus_per_worker, max_restarts=0)
        .remote(spec.model, turbo_model, spec.arcanima_adapters(kind), s3)
    )
    runs: dict[str, list[dict]] = {s.name: [] for s in settings}
    try:
        environment = ray.get(actor.environment.remote(), timeout=900)
        reference_ref = ray.put(reference)

        def measure(setting: TimingSetting) -> dict:
            ref = reference_ref if setting.reference else None
            return ray.get(actor.measure.remote(setting, spec.prompt, spec.seed, ref), timeout=3600)

        if spec.warmup:
            for setting in settings:
                measure(setting)
        for rep in range(spec.repetitions):
            ordered = settings if rep % 2 == 0 else settings[::-1]
            for setting in ordered:
                runs[setting.name].append(measure(setting))
                log.info(
                    "rep %d/%d %-22s %.3f s/image",
                    rep + 1,
                    spec.repetitions,
                    setting.name,
                    runs[setting.name][-1]["seconds_per_image"],
                )
    finally:
        ray.kill(actor)
    rows = _rows(settings, runs)
    _add_flop_ratios(rows, settings, spec)
    ref_size = Image.open(io.BytesIO(reference)).size
    summary = {
        "format": FORMAT,
        "title": spec.title or _default_title(environment),
        "environment": environment,
        "case": {
            "width": spec.width,
            "height": spec.height,
            "steps": spec.steps,
            "sampler": spec.sampler,
            "scheduler": "simple",
            "cfg": spec.cfg,
            "seed": spec.seed,
            "prompt": spec.prompt,
            "negative_prompt": spec.negative_prompt,
            "reference": reference_uri,
            "reference_size": list(ref_size),
        },
        "statistic": "median",
        "repetitions": spec.repetitions,
        "warmup": spec.warmup,
        "interleaved": True,
        "memory_metric": runs["no_reference"][0]["memory_metric"],
        "turbo_lora": spec.turbo_lora.model_dump() if spec.turbo_lora else None,
        "settings": rows,
        "left_out": left_out,
        "wall_seconds": round(time.time() - t_start, 3),
        "finished_at": time.time(),
    }
    storage.put_bytes(RESULT_JSON, json.dumps(summary, indent=2).encode(), "application/json")
    storage.put_bytes(RESULT_MD, format_markdown(summary).encode(), "text/markdown")
    log.info("timing table written to %s", storage.uri_for(RESULT_MD))
    return summary


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _rows(settings: list[TimingSetting], runs: dict[str, list[dict]]) -> list[dict]:
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


def _add_flop_ratios(rows: list[dict], settings: list[TimingSetting], spec: TimingSpec) -> None:
    """Each row's FLOP-model step ratio at 832x1216 (real Anima, 1 MP reference) beside the measured one."""
    from snapref_ray.adapter.controls import resolve_settings
    from snapref_ray.pipelines.flop_model import real_size_ratios
    from snapref_ray.sampling.ref_guidance import plan_step
    from snapref_ray.sampling.schedules import get_sigmas

    shares = {}
    for s in settings:
        resolved = resolve_settings(s.settings, s.adapter_kind or "snapref")
        sigmas = get_sigmas("simple", resolved.steps)[:-1]
        active = [plan_step(resolved, float(sig), s.reference).ref_guidance_active for sig in sigmas]
        shares[s.name] = sum(active) / len(active)
    ratios = real_size_ratios(shares, steps=spec.steps, cfg=spec.cfg != 1.0)
    for r in rows:
        r["flop_step_ratio_832x1216"] = ratios[r["name"]]
        r["ref_guidance_step_share"] = shares[r["name"]]


def _default_title(env: dict) -> str:
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
        "of real Anima at 832x1216 with a 1 MP reference (`snapref_ray/pipelines/flop_model.py`), against the "
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


JOB_USAGE = """`ray job submit --working-dir . -- python -m jobs.timing_table SPEC.yaml`

Measures one case under each setting (no reference, SnapRef default, ref_in_uncond, ref_guidance
with APG, ref_end 0.6, recompute every step, turbo) on one worker of the cluster the job was
submitted to; writes comparison_summary.json and comparison_summary.md to the spec's output.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=JOB_USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="timing spec YAML (local or s3://)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def job() -> int:
        print(format_markdown(run_timing(load_timing_spec(args.spec))))
        return 0

    return run_reporting_usage_errors(job)
