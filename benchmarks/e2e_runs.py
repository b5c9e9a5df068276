"""What the end-to-end phase runs, and how long each run will take: the runs, the recipe, the estimator.

A run (`RunSpec`) is an adapter x weights x compile mode, written `ADAPTER[-rgG]:bf16|fp8:eager|compiled`
(`--e2e-runs`; `compiled` starts from an empty compile cache and an empty local inductor cache, as a new
cluster does; `compiled-warm` from the compile cache its `compiled` twin published, as a new node does);
the recipe (`Recipe`) is the job each run renders. `RunEstimator` predicts a run's seconds
from the step phases and the runs already finished, so the phase starts only runs that fit its budget.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from snapref_ray.adapter.controls import resolve_settings
from snapref_ray.requests import RenderSettings
from snapref_ray.sampling.ref_guidance import step_rows

CFG, SAMPLER = 4.5, "er_sde"
ADAPTERS = {"snapref": "snapref", "v2": "arcanima-v2", "pilot": "arcanima-pilot"}
DEFAULT_RUNS = (
    "snapref:bf16:compiled,snapref:bf16:eager,snapref:fp8:compiled,snapref:fp8:eager,"
    "v2-rg1:bf16:compiled,v2-rg1:bf16:eager,pilot:bf16:compiled,pilot:bf16:eager,"
    "v2-rg1:fp8:compiled,v2-rg1:fp8:eager,pilot:fp8:compiled,pilot:fp8:eager"
)
# The smoke run: every code path once (compiled, fp8, both ArcAnima kinds), each a few seconds on a CPU.
SMOKE_RUNS = "snapref:bf16:compiled,v2-rg1:fp8:eager,pilot:bf16:eager"
# A compiled job builds three graphs: the warm-up's (one image, no reference), the memory probe's (one image
# reading the reference) and its batches'.
GRAPHS_PER_COMPILED_JOB = 3
# Seconds per real-size graph when the suite compiled none: the H200's 77 s (154 s for two graphs, README).
COMPILE_SECONDS_PER_GRAPH_PRIOR = 90.0
# ... and per graph loaded from the compile cache (the target: <= 5 s).
CACHED_GRAPH_SECONDS_PRIOR = 10.0


# --- what runs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """One end-to-end run: `ADAPTER[-rgG]:bf16|fp8:eager|compiled`, e.g. `v2-rg1:fp8:compiled`."""

    adapter: str  # a key of ADAPTERS
    ref_guidance: float | None  # None: the adapter kind's default
    weights: str  # "bf16" or "fp8" (the DiT's block linears in float8, model.quantize)
    compiled: bool
    warm_cache: bool = False  # compiled-warm: the compile cache the `compiled` twin published, a new local cache

    @property
    def kind(self) -> str:
        return ADAPTERS[self.adapter]

    @property
    def name(self) -> str:
        rg = "" if self.ref_guidance is None else f"-rg{self.ref_guidance:g}"
        mode = ("compiled-warm" if self.warm_cache else "compiled") if self.compiled else "eager"
        return f"{self.adapter}{rg}:{self.weights}:{mode}"

    @property
    def cache_name(self) -> str:
        """The compile cache's folder name: shared by a `compiled` run and its `compiled-warm` twin."""
        return self.name.removesuffix("-warm").replace(":", "-")

    def row_settings(self) -> dict[str, Any]:
        """Row defaults this run adds to the recipe's."""
        return {} if self.ref_guidance is None else {"ref_guidance": self.ref_guidance}

    def weighted_rows(self) -> int:
        """DiT rows per image and step, a pilot row that reads (two latent frames) counted twice."""
        settings = resolve_settings(RenderSettings(cfg=CFG, **self.row_settings()), self.kind)
        plan = step_rows(settings, 0.5, True)
        frames = 2 if self.kind == "arcanima-pilot" else 1
        return sum(frames if reads else 1 for reads in plan.reads)


def parse_runs(text: str) -> list[RunSpec]:
    """`--e2e-runs`: comma-separated `ADAPTER[-rgG]:bf16|fp8:eager|compiled`; '' or 'none' for no runs."""
    if text.strip().lower() in ("", "none"):
        return []
    runs = []
    for token in (t.strip() for t in text.split(",")):
        parts = token.split(":")
        if len(parts) != 3:
            raise ValueError(f"--e2e-runs: {token!r} is not ADAPTER[-rgG]:bf16|fp8:eager|compiled")
        adapter, _, rg = parts[0].partition("-rg")
        if adapter not in ADAPTERS:
            raise ValueError(f"--e2e-runs: {token!r}: adapter must be one of {', '.join(ADAPTERS)}, found {adapter!r}")
        if parts[1] not in ("bf16", "fp8") or parts[2] not in ("eager", "compiled", "compiled-warm"):
            raise ValueError(f"--e2e-runs: {token!r}: expected bf16|fp8 then eager|compiled|compiled-warm")
        try:
            guidance = float(rg) if rg else None
        except ValueError:
            raise ValueError(f"--e2e-runs: {token!r}: -rg must be followed by a number, found {rg!r}") from None
        run = RunSpec(adapter, guidance, parts[1], parts[2] != "eager", parts[2] == "compiled-warm")
        if run in runs:
            raise ValueError(f"--e2e-runs: {token!r} is listed twice")
        runs.append(run)
    return runs


@dataclass(frozen=True)
class Recipe:
    """The job every run renders."""

    width: int
    height: int
    steps: int
    references: int
    prompts_per_reference: int
    reference_side: int  # px of the square references (1024: about 1 MP, fitted to 992x992 by the engine)

    @property
    def images(self) -> int:
        return self.references * self.prompts_per_reference

    def describe(self) -> str:
        return (
            f"{self.width}x{self.height}, {self.steps} steps {SAMPLER}, CFG {CFG:g}, {self.references} reference(s)"
            f" x {self.prompts_per_reference} prompts"
        )


REAL_RECIPE = Recipe(832, 1216, 30, 2, 16, reference_side=1024)
SMOKE_RECIPE = Recipe(256, 256, 2, 1, 2, reference_side=128)
RECIPES = {"real": REAL_RECIPE, "scaled": Recipe(416, 608, 30, 2, 16, reference_side=512), "smoke": SMOKE_RECIPE}


# --- the budget --------------------------------------------------------------------------------------


@dataclass
class Done:
    """What a finished run tells the estimator."""

    run: RunSpec
    wall_seconds: float
    sampling_seconds: float  # the job's DiT sampling
    images: int
    steps: int


class RunEstimator:
    """How long a run will take: fixed seconds (start-up, compiles, everything but sampling) + sampling seconds.

    Sampling = images x steps x weighted rows (`RunSpec.weighted_rows`) x seconds per weighted row-step,
    the latter from, in order: finished runs of the same compile mode and weights (the slowest), of the
    same compile mode, the step phases' SnapRef-default step of that mode (`step_seconds[mode]`, for
    `step_batch` images of 2 rows), any finished run, the step phases' step of the other mode.
    Fixed seconds: the largest of the finished runs of the same compile mode (wall less sampling); else
    `startup_prior_s`, plus for a compiled run `GRAPHS_PER_COMPILED_JOB` graphs of
    `compile_seconds_per_graph` (the step phases' measure, else `COMPILE_SECONDS_PER_GRAPH_PRIOR`).
    Rough by design (fp8 and ArcAnima's LoRAs are not modelled): it decides what to start, nothing more.
    """

    def __init__(
        self,
        recipe: Recipe,
        *,
        step_seconds: dict[str, float],
        step_batch: int,
        compile_seconds_per_graph: float | None,
        startup_prior_s: float,
    ) -> None:
        self.recipe, self.step_seconds, self.step_batch = recipe, step_seconds, step_batch
        self.compile_seconds_per_graph = compile_seconds_per_graph
        self.startup_prior_s = startup_prior_s
        self.done: list[Done] = []

    @staticmethod
    def _per_row_step(d: Done) -> float:
        return d.sampling_seconds / (d.images * d.steps * d.run.weighted_rows())

    def estimate(self, run: RunSpec) -> tuple[float | None, str]:
        """(seconds, what the estimate rests on); None seconds before anything was measured."""
        mode = "compiled" if run.compiled else "eager"
        same_mode = [d for d in self.done if d.run.compiled == run.compiled]
        same_weights = [d for d in same_mode if d.run.weights == run.weights]
        if same_weights or same_mode:
            unit = max(self._per_row_step(d) for d in same_weights or same_mode)
            basis = f"sampling as the finished {mode} {run.weights + ' ' if same_weights else ''}runs"
        elif mode in self.step_seconds:
            unit = self.step_seconds[mode] / (self.step_batch * 2)
            basis = f"sampling as the step phase's {mode} SnapRef step"
        elif self.done:
            unit = max(self._per_row_step(d) for d in self.done)
            basis = "sampling as the finished runs"
        elif self.step_seconds:
            other = next(iter(self.step_seconds))
            unit = self.step_seconds[other] / (self.step_batch * 2)
            basis = f"sampling as the step phase's {other} SnapRef step"
        else:
            unit = None
            basis = "nothing measured yet"
        same_cache = [d for d in same_mode if d.run.warm_cache == run.warm_cache]
        if same_cache:
            fixed = max(d.wall_seconds - d.sampling_seconds for d in same_cache)
            basis += f", fixed time as the finished {run.name.rsplit(':', 1)[1]} runs"
        else:
            fixed = self.startup_prior_s
            if run.compiled:
                per_graph = (
                    CACHED_GRAPH_SECONDS_PRIOR
                    if run.warm_cache
                    else self.compile_seconds_per_graph or COMPILE_SECONDS_PER_GRAPH_PRIOR
                )
                fixed += GRAPHS_PER_COMPILED_JOB * per_graph
                graphs = f"{GRAPHS_PER_COMPILED_JOB} graphs x {per_graph:.0f} s"
                basis += f", start-up {self.startup_prior_s:.0f} s + {graphs}"
            else:
                basis += f", start-up {self.startup_prior_s:.0f} s"
        if unit is None:
            return None, basis
        sampling = self.recipe.images * self.recipe.steps * run.weighted_rows() * unit
        return fixed + sampling, basis


def parse_images(text: str) -> tuple[int, int]:
    """`--e2e-images REFSxPROMPTS` -> (references, prompts per reference)."""
    refs, sep, prompts = text.lower().partition("x")
    if not sep or not refs.isdigit() or not prompts.isdigit() or int(refs) < 1 or int(prompts) < 1:
        raise ValueError(f"--e2e-images must be REFERENCESxPROMPTS (e.g. 2x16), found {text!r}")
    return int(refs), int(prompts)


def recipe_for(base: Recipe, *, images: str | None = None, steps: int | None = None) -> Recipe:
    """`base` with `--e2e-images` / `--e2e-steps` applied (at least 2 steps: 1-step renders are the memory probe's)."""
    refs, prompts = parse_images(images) if images else (base.references, base.prompts_per_reference)
    steps = base.steps if steps is None else steps
    if steps < 2:
        raise ValueError(f"--e2e-steps must be at least 2 (1-step renders are the memory probe's), found {steps}")
    return replace(base, steps=steps, references=refs, prompts_per_reference=prompts)
