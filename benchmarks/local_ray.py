"""The benchmarks' own local Ray, for when a script runs by itself (the tests run them on theirs)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def start_local_ray(extra_env: dict[str, str] | None = None, **init_kwargs: Any) -> Callable[[], None]:
    """`ray.init(address="local", ...)` whose workers import this checkout (benchmarks/, the project) and
    see `extra_env`; returns the call that shuts that Ray down and restores this process's environment.

    The variables go into this process's environment before Ray starts: the raylet it starts, and
    every worker the raylet starts, inherit them. A job `runtime_env` would give the workers the same,
    but Ray starts each worker of such a job through its `setup_worker.py`, a second Python start that
    imports Ray: 1.7 CPU-s against 1.0 for an empty actor on a 2-core machine.
    """
    import ray

    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, **(extra_env or {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)

    def stop() -> None:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    try:
        ray.init(address="local", include_dashboard=False, log_to_driver=False, **init_kwargs)
    except BaseException:
        stop()
        raise
    return stop
