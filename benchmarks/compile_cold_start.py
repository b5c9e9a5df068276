"""Cold start of a compiled render on the CPU: eager vs compiled with empty caches vs a new node.

Each run is a fresh `snapref-ray txt2img` process on the 28-block tiny model (`make-tiny --blocks 28`),
256x256, 4 steps, timed from the process start to its exit:

- `eager`: no compile;
- `compiled_cold`: `--compile`, an empty local inductor cache (TORCHINDUCTOR_CACHE_DIR) and an empty
  `--compile-cache`: every graph is built, then published to the compile cache;
- `compiled_new_node`: `--compile` with the compile cache the previous run published and another empty
  local inductor cache, as a new node of the cluster starts;
- `compiled_warm_local`: the same process again with the previous run's local inductor cache (a restart
  on the same node).

Wall seconds and CPU seconds (user + system of the process and everything it started: inductor's
compile workers, the C++ compiler) per run; on a machine shared with other jobs the CPU seconds are the
steadier figure. Prints one JSON line per run and a table of ratios against eager (issue targets: cold <= 5x, new node
<= 2.5x). Writes `compile_cold_start.json` under --out-dir when given. On a quiet machine; the figures
in docs/performance.md name theirs.

    python -m benchmarks.compile_cold_start [--out-dir DIR] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = ("eager", "compiled_cold", "compiled_new_node", "compiled_warm_local")


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(models: Path, out: Path, env: dict[str, str], extra: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one txt2img process."""
    argv = [sys.executable, "-m", "snapref_ray.cli", "txt2img", "--models", str(models), "--prompt", "1girl, solo"]
    argv += ["--out", str(out), "--width", "256", "--height", "256", "--steps", "4", "--seed", "1", "--device", "cpu"]
    t0, cpu0 = time.perf_counter(), _children_cpu_seconds()
    done = subprocess.run(argv + extra, env=env, capture_output=True, text=True)
    seconds, cpu = time.perf_counter() - t0, _children_cpu_seconds() - cpu0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv + extra)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, cpu


def measure(work: Path, repeats: int = 1) -> list[dict]:
    """The four runs (each `repeats` times, the best kept), in fresh processes, under `work`."""
    models = work / "tiny28"
    if not models.exists():
        subprocess.run(
            [sys.executable, "-m", "snapref_ray.cli", "make-tiny", str(models), "--blocks", "28"],
            check=True,
            capture_output=True,
        )
    base_env = {**os.environ, "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "0"}
    results: dict[str, tuple[float, float]] = {}
    for repeat in range(repeats):
        shared = work / f"compile-cache-{repeat}"
        local = [work / f"inductor-{repeat}-{i}" for i in range(2)]
        plans = {
            "eager": ({}, []),
            "compiled_cold": (
                {"TORCHINDUCTOR_CACHE_DIR": str(local[0])},
                ["--compile", "--compile-cache", str(shared)],
            ),
            "compiled_new_node": (
                {"TORCHINDUCTOR_CACHE_DIR": str(local[1])},
                ["--compile", "--compile-cache", str(shared)],
            ),
            "compiled_warm_local": (
                {"TORCHINDUCTOR_CACHE_DIR": str(local[1])},
                ["--compile", "--compile-cache", str(work / f"unused-{repeat}")],
            ),
        }
        for name in RUNS:
            env, extra = plans[name]
            seconds, cpu = _run(models, work / f"{name}-{repeat}.png", {**base_env, **env}, extra)
            best = results.get(name, (float("inf"), float("inf")))
            results[name] = (min(best[0], seconds), min(best[1], cpu))
            print(json.dumps({"run": name, "repeat": repeat, "seconds": round(seconds, 2), "cpu_s": round(cpu, 2)}))
    (wall, cpu) = results["eager"]
    return [
        {
            "run": name,
            "seconds": round(results[name][0], 2),
            "vs_eager": round(results[name][0] / wall, 2),
            "cpu_seconds": round(results[name][1], 2),
            "cpu_vs_eager": round(results[name][1] / cpu, 2),
        }
        for name in RUNS
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the model and caches here (default: temp)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="compile-cold-start-") as tmp:
        rows = measure(args.work_dir or Path(tmp), args.repeats)
    print(f"{'run':<22} {'wall s':>8} {'x eager':>8} {'CPU s':>8} {'x eager':>8}")
    for row in rows:
        print(
            f"{row['run']:<22} {row['seconds']:>8.2f} {row['vs_eager']:>8.2f}"
            f" {row['cpu_seconds']:>8.2f} {row['cpu_vs_eager']:>8.2f}"
        )
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "compile_cold_start.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
