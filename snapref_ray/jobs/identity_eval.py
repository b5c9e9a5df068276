"""The identity-gap evaluation as a Ray job: heldout_loss.json + heldout_loss.parquet out.

manifest rows (reference, target, prompt[, character, id]) -> each case gets a wrong reference
from another character (a seeded derangement) -> the batch job's RenderWorkers compute both loss
grids per case (`RenderWorker.evaluate`; cases of one reference go to one worker so its RefKV is
encoded once there) -> `snapref_ray.evaluation.summarise` -> files. The loss and the statistics
are defined in snapref_ray/evaluation.py; the files are described in docs/evaluate.md.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import platform
import time
from typing import ClassVar

from pydantic import Field, field_validator

from snapref_ray.adapter.images import content_hash
from snapref_ray.evaluation import LOSS_DEFINITION, derangement, summarise
from snapref_ray.job_spec import ClusterSpec, OutputSpec, SpecFile, load_spec_file
from snapref_ray.jobs.places import check_places
from snapref_ray.model_spec import ModelSpec
from snapref_ray.requests import Mode
from snapref_ray.storage.backends import S3Options, open_storage, read_uri
from snapref_ray.storage.manifest import read_manifest
from snapref_ray.uris import base_of, resolve_relative
from snapref_ray.validation import run_reporting_usage_errors

log = logging.getLogger(__name__)

RESULT_JSON = "heldout_loss.json"
RESULT_PARQUET = "heldout_loss.parquet"
FORMAT = "snapref-ray/heldout_loss/1"
MANIFEST_COLUMNS = ("reference", "target", "prompt", "character", "id")
_REQUIRED_COLUMNS = ("reference", "target", "prompt")


class EvalError(ValueError):
    """An evaluation that cannot produce a result (bad manifest, every case failed)."""


# ---------------------------------------------------------------------------------------------
# Spec


class EvalSpec(SpecFile):
    """An identity-gap evaluation: the model, a manifest of held-out cases, σ/seed grid, output, cluster."""

    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("manifest",)

    model: ModelSpec = Field(
        ..., description="The model and the adapter under test (as in a batch job spec); LoRAs none = the base model."
    )
    manifest: str = Field(
        ...,
        description="CSV/JSONL/Parquet with columns reference, target, prompt and optional "
        "character and id; relative paths resolve against its folder.",
    )
    sigmas: list[float] = Field(
        [0.2, 0.4, 0.6, 0.8],
        description="Noise levels the loss is taken at; spread over "
        "the schedule because identity is decided at middle σ, not at the ends.",
    )
    noise_seeds: list[int] = Field(
        [0, 1, 2, 3],
        description="Noise draws per σ, shared by right and wrong "
        "reference so the gap is a paired difference; 4 keep the per-case noise low at 4x "
        "the cost of 1.",
    )
    derangement_seed: int = Field(0, description="Seed of the wrong-reference assignment; fixed so reruns compare.")
    bootstrap_seed: int = Field(0, description="Seed of the bootstrap resampling; fixed so the CI is reproducible.")
    n_boot: int = Field(
        2000,
        ge=100,
        description="Bootstrap replicates; 2000 puts the 95% bounds' own noise well below the interval's width.",
    )
    ci_level: float = Field(0.95, gt=0.0, lt=1.0, description="Confidence level of the gap's interval.")
    target_megapixels: float = Field(
        1.0,
        gt=0.0,
        le=16.0,
        description="Targets are shrunk to at most this area "
        "(sides multiples of 16, never enlarged); 1 MP as the adapter was trained.",
    )
    mode: Mode = Field("cs", description="Reference read mode; cs as trained for character and style.")
    ref_weight: float = Field(1.0, ge=0.0, le=10.0, description="Reference attention weight; 1 as trained.")
    ref_caption: str = Field(
        "", description="Caption of every reference for its own cross-attention; empty as in the default render."
    )
    ref_megapixels: float = Field(1.0, gt=0.0, le=16.0, description="Reference area budget; 1 MP as trained.")
    output: OutputSpec = Field(default_factory=OutputSpec, description="Where heldout_loss.json/.parquet go.")
    cluster: ClusterSpec = Field(
        default_factory=ClusterSpec, description="Ray cluster and worker shape (the batch job's fields)."
    )

    @field_validator("sigmas")
    @classmethod
    def _sigmas(cls, v: list[float]) -> list[float]:
        if not v or any(not 0.0 < s <= 1.0 for s in v) or len(set(v)) != len(v):
            raise ValueError(f"sigmas must be distinct values in (0, 1], at least one; got {v}")
        return v

    @field_validator("noise_seeds")
    @classmethod
    def _seeds(cls, v: list[int]) -> list[int]:
        if not v or any(s < 0 for s in v) or len(set(v)) != len(v):
            raise ValueError(f"noise_seeds must be distinct non-negative integers, at least one; got {v}")
        return v

    def s3_options(self) -> S3Options:
        return self.output.s3.options()


def load_eval_spec(path_or_uri: str, s3: S3Options | None = None) -> EvalSpec:
    """Load an evaluation spec YAML (snapref_ray/examples/example_eval_spec.yaml shows every field)."""
    return load_spec_file(path_or_uri, EvalSpec, s3, what="evaluation spec")


# ---------------------------------------------------------------------------------------------
# Cases


def build_cases(spec: EvalSpec, s3: S3Options | None = None) -> list[dict]:
    """Read and check the manifest; one case dict per row, each with its wrong reference assigned.

    A character id defaults to the reference image's content hash (one image = one character).
    Any bad row is an EvalError naming the row: dropping cases silently would change the statistic.
    """
    rows = read_manifest(spec.manifest, s3)
    base = base_of(spec.manifest)
    problems, cases, hashes = [], [], {}
    for row in rows:
        number = row.pop("__row__")
        unknown = sorted(set(row) - set(MANIFEST_COLUMNS))
        missing = [c for c in _REQUIRED_COLUMNS if c not in row]
        if unknown or missing:
            reasons = [f"missing {', '.join(missing)}"] if missing else []
            if unknown:
                reasons.insert(0, f"unknown column(s) {', '.join(unknown)} (allowed: {', '.join(MANIFEST_COLUMNS)})")
            problems.append(f"row {number}: " + "; ".join(reasons))
            continue
        reference = resolve_relative(str(row["reference"]), base)
        if reference not in hashes:
            try:
                hashes[reference] = content_hash(read_uri(reference, s3))
            except Exception as e:
                problems.append(f"row {number}: reference {reference} cannot be read ({type(e).__name__}: {e})")
                continue
        character = str(row["character"]) if "character" in row else f"ref:{hashes[reference][:12]}"
        cases.append(
            {
                "case_id": str(row.get("id", f"row{number}")),
                "manifest_row": number,
                "character": character,
                "reference": reference,
                "target": resolve_relative(str(row["target"]), base),
                "prompt": str(row["prompt"]),
            }
        )
    seen: set[str] = set()
    for case in cases:
        if case["case_id"] in seen:
            problems.append(f"row {case['manifest_row']}: duplicate id {case['case_id']!r}")
        seen.add(case["case_id"])
    if problems:
        raise EvalError(f"manifest {spec.manifest}: {len(problems)} bad row(s):\n  " + "\n  ".join(problems[:50]))
    try:
        wrong = derangement(len(cases), spec.derangement_seed, [c["character"] for c in cases])
    except ValueError as e:
        raise EvalError(f"manifest {spec.manifest}: {e}") from None
    for case, j in zip(cases, wrong):
        other = cases[j]
        case.update(
            {
                "wrong_reference": other["reference"],
                "wrong_character": other["character"],
                "wrong_case": other["case_id"],
            }
        )
        if hashes[other["reference"]] == hashes[case["reference"]]:
            log.warning(
                "case %s: characters %r and %r share a reference image; its gap is 0 by construction",
                case["case_id"],
                case["character"],
                other["character"],
            )
    for case in cases:
        case.update(
            {
                "right_hash": hashes[case["reference"]],
                "right_uris": [case["reference"]],
                "wrong_hash": hashes[case["wrong_reference"]],
                "wrong_uris": [case["wrong_reference"]],
                "layout": "single",
                "sigmas": list(spec.sigmas),
                "noise_seeds": list(spec.noise_seeds),
                "target_megapixels": spec.target_megapixels,
                "mode": spec.mode,
                "ref_weight": spec.ref_weight,
                "ref_caption": spec.ref_caption,
                "ref_megapixels": spec.ref_megapixels,
            }
        )
    return cases


# ---------------------------------------------------------------------------------------------
# Running


def _dispatch(workers: list, cases: list[dict], per_worker: int, max_attempts: int) -> tuple[dict, dict]:
    """Run every case on the workers; (results by case index, errors by case index). The decisions (affinity per
    reference, retries) are the policy's (jobs/identity_eval_policy.py); the engine core's loop sends and collects."""
    import ray

    from snapref_ray.cluster.call_records import CallKind
    from snapref_ray.cluster.engine_core import EngineCore
    from snapref_ray.cluster.scheduling_policy import StepOutcome
    from snapref_ray.jobs.identity_eval_policy import IdentityEvalPolicy

    def classify(error: Exception) -> str | None:
        """Any Ray error is the cluster's (the worker died; Ray already retried once); anything else is raised."""
        return type(error).__name__ if isinstance(error, ray.exceptions.RayError) else None

    def log_requeues(outcome: StepOutcome) -> None:
        for i in outcome.requeued:
            log.warning("case %s: lost to the cluster; retrying", cases[i]["case_id"])

    policy = IdentityEvalPolicy(cases, len(workers), max_attempts)
    core = EngineCore(
        workers,
        policy,
        kind=CallKind.EVALUATE,
        per_worker=per_worker,
        classify=classify,
        wait_timeout_s=60.0,
        on_step=log_requeues,
    )
    core.run()
    return policy.results, policy.errors


def _worker_memory(spec: EvalSpec, *, on_gpu: bool) -> int:
    """The host memory an evaluation worker asks Ray for, by the rule a job's workers ask by
    (render_service/memory_estimate.py): `cluster.memory_per_worker`, else the estimate for a square target of
    `target_megapixels` (a target is never larger). One σ's noise seeds run as one forward of a row each, and the
    estimate's image holds three rows, so a forward of N seeds counts as N/3 images."""
    from snapref_ray.geometry import square_side
    from snapref_ray.render_service.memory_estimate import memory_request

    side = square_side(spec.target_megapixels)
    batch = -(-len(spec.noise_seeds) // 3)
    return memory_request(
        spec.model, override=spec.cluster.memory_per_worker, width=side, height=side, batch=batch, on_gpu=on_gpu
    )[0]


def run_identity_eval(spec: EvalSpec, *, renderer_factory=None) -> dict:
    """Run the evaluation on Ray workers; returns what is written to heldout_loss.json."""
    from snapref_ray.cluster.pool import PoolShape, connect, on_a_cluster, start_workers
    from snapref_ray.cluster.worker import WorkerConfig

    t_start = time.time()
    check_places(spec, spec.manifest)  # one line for a place that cannot work, not minutes of retries
    s3 = spec.s3_options()
    storage = open_storage(spec.output.uri, s3)
    cases = build_cases(spec, s3)
    log.info(
        "%d cases of %d characters; %d sigmas x %d noise seeds each, right and wrong reference",
        len(cases),
        len({c["character"] for c in cases}),
        len(spec.sigmas),
        len(spec.noise_seeds),
    )
    c = spec.cluster
    config = WorkerConfig(
        model=spec.model,
        refkv_cache_bytes=c.refkv_cache_bytes,
        output_uri=spec.output.uri,
        s3=s3,
        warmup=False,
    )
    connect(c.address)
    import ray

    workers, _ = start_workers(
        config,
        PoolShape(c.num_workers, c.cpu_workers, c.num_cpus_per_worker),
        renderer_factory,
        on_cluster=on_a_cluster(c.address),
        memory_bytes=lambda on_gpu: _worker_memory(spec, on_gpu=on_gpu),
    )
    try:
        results, errors = _dispatch(workers, cases, c.max_in_flight_per_worker, c.max_attempts)
    finally:
        for worker in workers:
            ray.kill(worker)
    if not results:
        first = next(iter(errors.values()), "no result")
        raise EvalError(f"every one of the {len(cases)} cases failed; the first error: {first}")
    done = [
        {**_public(cases[i]), **{k: v for k, v in results[i].items() if k not in _RUN_FIELDS}} for i in sorted(results)
    ]
    summary = summarise(done, sigmas=spec.sigmas, seed=spec.bootstrap_seed, n_boot=spec.n_boot, level=spec.ci_level)
    first = results[min(results)]
    report = {
        "format": FORMAT,
        **{k: v for k, v in summary.items() if k not in ("cases", "per_sigma")},
        "n_failed": len(errors),
        "sigmas": list(spec.sigmas),
        "noise_seeds": list(spec.noise_seeds),
        "loss": LOSS_DEFINITION,
        "model": {
            "id": first["model"],
            "files": spec.model.model_dump(exclude={"adapter", "loras", "device", "dtype", "compile", "quantize"}),
            "loras": [lora.model_dump() for lora in spec.model.loras],
            "device": first["device"],
            "dtype": first["dtype"],
        },
        "adapter": {
            "identity": first["adapter"],
            "kind": first["adapter_kind"],
            "path": spec.model.adapter,
            "mode": spec.mode,
            "ref_weight": spec.ref_weight,
            "ref_caption": spec.ref_caption,
            "ref_megapixels": spec.ref_megapixels,
        },
        "target_megapixels": spec.target_megapixels,
        "derangement_seed": spec.derangement_seed,
        "manifest": spec.manifest,
        "per_sigma": summary["per_sigma"],
        "cases": summary["cases"],  # summarise() leaves the grids out; they are in the Parquet
        "failed": [
            {"case_id": cases[i]["case_id"], "manifest_row": cases[i]["manifest_row"], "error": errors[i]}
            for i in sorted(errors)
        ],
        "wall_seconds": round(time.time() - t_start, 3),
        "python": platform.python_version(),
        "finished_at": time.time(),
    }
    storage.put_bytes(RESULT_JSON, json.dumps(report, indent=2).encode(), "application/json")
    storage.put_bytes(RESULT_PARQUET, _parquet(summary["cases"], done))
    log.info(
        "identity gap %.6g (%.0f%% CI %.6g .. %.6g), right wins %.0f%% of %d cases; written to %s",
        report["gap"],
        100 * spec.ci_level,
        *report["gap_ci"],
        100 * report["right_wins_fraction"],
        report["n_cases"],
        storage.uri_for(RESULT_JSON),
    )
    return report


# Per-worker facts, reported once under "model"/"adapter" rather than in every case.
_RUN_FIELDS = ("case_id", "model", "adapter", "adapter_kind", "device", "dtype")
_CASE_FIELDS = (
    "case_id",
    "manifest_row",
    "character",
    "reference",
    "target",
    "prompt",
    "wrong_reference",
    "wrong_character",
    "wrong_case",
)


def _public(case: dict) -> dict:
    """The fields of a case that describe it in the outputs (not the worker's instructions)."""
    return {k: case[k] for k in _CASE_FIELDS}


def _parquet(summary_cases: list[dict], done: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    grids = {case["case_id"]: case for case in done}
    rows = [
        {**case, "loss_right": grids[case["case_id"]]["loss_right"], "loss_wrong": grids[case["case_id"]]["loss_wrong"]}
        for case in summary_cases
    ]
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue()


JOB_USAGE = """`ray job submit --working-dir . -- python -m jobs.identity_eval SPEC.yaml`

Runs an identity-gap evaluation spec (snapref_ray/examples/example_eval_spec.yaml) on the cluster the job was
submitted to (RAY_ADDRESS is set by `ray job submit`); writes heldout_loss.json and
heldout_loss.parquet to the spec's output.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=JOB_USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="evaluation spec YAML (local or s3://)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_reporting_usage_errors(lambda: _report(run_identity_eval(load_eval_spec(args.spec))))


def _report(report: dict) -> int:
    keys = ("n_cases", "n_failed", "mean_loss_right", "mean_loss_wrong", "gap", "gap_ci", "right_wins_fraction")
    print(json.dumps({k: report[k] for k in keys}, indent=2))
    return 1 if report["n_failed"] else 0
