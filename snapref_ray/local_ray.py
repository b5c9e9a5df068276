"""A Ray started on this machine by a command (a job's driver, `snapref-ray serve`), as both start it."""

from __future__ import annotations

import ray


def start_local_ray(*, num_cpus: int | None = None, num_gpus: int | None = None, log_to_driver: bool = True) -> None:
    """Start Ray in this process's machine and connect to it.

    "local" never attaches to a stale cluster left by an unclean exit. No dashboard: nothing reads it on a
    single machine, and it is one more process. No prestarted workers: Ray would start an idle Python worker per
    CPU for the first driver's tasks (~80 MiB and ~0.4 CPU-s each), while a job's workers and Serve's replicas are
    actors, each started when asked for, and the few tasks they run start their own.
    """
    ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        log_to_driver=log_to_driver,
        _system_config={"prestart_worker_first_driver": False},
    )
