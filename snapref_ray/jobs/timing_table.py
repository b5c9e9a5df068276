"""The side-by-side timing table as a Ray job: comparison_summary.json + comparison_summary.md out.

One case (size, steps, sampler, prompt, seed, reference) rendered under each setting on one Ray
actor that owns a render service per model (the service every front door renders through);
settings are measured interleaved (every repetition runs each setting once, in alternating order)
so drift in clocks or load spreads over all of them, and the table reports medians. Ratios are
computed from those medians against the no-reference row.

The parts: the spec (timing_spec.py), the catalogue of rows as data (timing_catalogue.py) and the rows
of one spec (timing_settings.py), the actor that measures (timing_worker.py), the figures and the
Markdown (timing_report.py); this module runs them.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import time

from PIL import Image

from snapref_ray.jobs.places import check_places
from snapref_ray.jobs.timing_report import add_flop_ratios, default_title, format_markdown, table_rows
from snapref_ray.jobs.timing_settings import TimingSetting, settings_to_time
from snapref_ray.jobs.timing_spec import TimingSpec, load_timing_spec
from snapref_ray.jobs.timing_worker import TimingWorker
from snapref_ray.storage.backends import open_storage, read_uri
from snapref_ray.validation import run_reporting_usage_errors

log = logging.getLogger(__name__)

RESULT_JSON = "comparison_summary.json"
RESULT_MD = "comparison_summary.md"
FORMAT = "snapref-ray/comparison_summary/1"


def _worker_memory(spec: TimingSpec, *, turbo: bool, on_gpu: bool) -> int:
    """The host memory the timing actor asks Ray for, by the rule a job's workers ask by
    (render_service/memory_estimate.py): `cluster.memory_per_worker`, else the estimate for one image of the
    case's size; on a CPU, a turbo renderer loaded beside the base one holds a second copy of the weights."""
    from snapref_ray.render_service.memory_estimate import memory_request

    memory, estimate = memory_request(
        spec.model,
        override=spec.cluster.memory_per_worker,
        width=spec.width,
        height=spec.height,
        batch=1,
        on_gpu=on_gpu,
    )
    second_copy = turbo and estimate is not None and not on_gpu  # a GPU streams each file through host memory
    return memory + (estimate.weight_bytes if second_copy else 0)


def run_timing(spec: TimingSpec) -> dict:
    """Measure every setting on one Ray actor; writes comparison_summary.json/.md and returns the JSON."""
    import ray

    from snapref_ray.cluster.pool import connect
    from snapref_ray.render_service.loading import adapter_file, adapter_kind

    t_start = time.time()
    check_places(spec, spec.reference_uri())  # one line for a place that cannot work, not minutes of retries
    s3 = spec.s3_options()
    storage = open_storage(spec.output.uri, s3)
    kind = adapter_kind(spec.model, s3=s3)
    if kind is not None and spec.model.adapter is None:  # the models folder's adapter: name it, its rows use it
        spec = spec.model_copy(
            update={"model": spec.model.model_copy(update={"adapter": str(adapter_file(spec.model, s3=s3))})}
        )
    settings, left_out = settings_to_time(spec, kind)
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
    memory = _worker_memory(spec, turbo=turbo_model is not None, on_gpu=use_gpu)
    actor = (
        ray.remote(TimingWorker)
        .options(
            num_gpus=1 if use_gpu else 0,
            num_cpus=c.num_cpus_per_worker,
            max_restarts=0,
            **({"memory": memory} if memory else {}),
        )
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
    rows = table_rows(settings, runs)
    add_flop_ratios(rows, settings, spec)
    ref_size = Image.open(io.BytesIO(reference)).size
    summary = {
        "format": FORMAT,
        "title": spec.title or default_title(environment),
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
