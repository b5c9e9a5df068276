"""What a failure means: the item's own (an attempt), or the infrastructure's (a requeue that costs no attempt).

Everything here is decided by exception class (`ray.exceptions`, `torch.OutOfMemoryError`), never by message text:
Ray's messages change between releases, its class hierarchy is its API.

- `LOST_REFKV_ERRORS`: a RefKV fetch failed because the object is gone or cannot be produced in time — lost with its
  node, its owner or its creating actor dead (lineage rebuilds it through that actor), the actor unavailable, the
  fetch timed out. The worker encodes the reference itself instead (cluster/worker.py).
- `infrastructure_cause`: why a render call raised at the driver. A worker process or node that died, Ray's memory
  monitor killing the worker, or a call the scheduler cancelled are the cluster's failures and requeue the batch
  for free (a job-wide budget bounds them, cluster/recovery.py); anything else (`RayTaskError`: the call's own
  code raised) is charged to the items.
- `describe_out_of_memory`: the worker's report of a `torch.OutOfMemoryError`, with the device's memory figures,
  so that the driver can split the batch and, for a single image, fail it with numbers a person can act on.

Telling a dead node from a dead worker process: at the moment a call fails, Ray's error does not say. A raylet
that is SIGKILLed (a machine lost) shows up as `ActorUnavailableError` ("failed to connect") on in-flight calls
within seconds, while the GCS still lists the node alive until its health checks give up (~15 s with Ray 2.60's
defaults), and the actor is restarted elsewhere only after that. So recovery (cluster/recovery.py) classifies a lost
worker later, from `ray.nodes()` (`dead_nodes`): when the worker answers its probe again or Ray declares it dead for
good (either comes after Ray declared its node dead, had the node died), or at the end of the job. An
`ActorDiedError` with `preempted` set (the autoscaler drained the node) is a node loss at once.
"""

from __future__ import annotations

import sys

import ray

from snapref_ray.cluster.scheduler_stats import REQUEUE_CAUSES, RESTARTING, Cause
from snapref_ray.render_service.memory import describe_device_memory

LOST_REFKV_ERRORS: tuple[type[BaseException], ...] = (
    ray.exceptions.ObjectLostError,  # and OwnerDiedError, ObjectFetchTimedOutError, ObjectFreedError,
    # ObjectReconstructionFailedError, ReferenceCountingAssertionError
    ray.exceptions.RayActorError,  # ActorDiedError, ActorUnavailableError: the creating actor lineage needs
    ray.exceptions.NodeDiedError,
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.OutOfMemoryError,  # the reconstruction was killed by the memory monitor
    ray.exceptions.GetTimeoutError,  # the fetch timeout: waiting on a rebuild costs more than an encode
)

# A render call that raised one of these never ran to its end for a reason outside its items.
_LOST_WORKER_ERRORS: tuple[type[BaseException], ...] = (
    ray.exceptions.RayActorError,
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.LocalRayletDiedError,
    ray.exceptions.ObjectLostError,  # the call's small return was lost with its node
)


def infrastructure_cause(error: BaseException) -> Cause | None:
    """The infrastructure failure behind a render call that raised at the driver, or None when the call's own
    code raised (a `RayTaskError` that is none of these: charged to its items).

    A lost worker is `WORKER_LOST` until its node is known dead (see the module docstring), except a preempted
    one. Out-of-memory is checked first: a `RayTaskError` that wraps it is an instance of it too.
    """
    if isinstance(error, ray.exceptions.OutOfMemoryError):
        return Cause.OOM_KILLED
    if _is_device_out_of_memory(error):
        return Cause.DEVICE_OOM
    if isinstance(error, ray.exceptions.RayTaskError):
        return None
    if isinstance(error, ray.exceptions.TaskCancelledError):  # only the scheduler cancels calls
        return Cause.RELEASED
    if isinstance(error, ray.exceptions.RayActorError) and error.preempted:
        return Cause.NODE_LOST
    if isinstance(error, _LOST_WORKER_ERRORS):
        return Cause.WORKER_LOST
    return None


def _is_device_out_of_memory(error: BaseException) -> bool:
    """`torch.OutOfMemoryError`, asked without importing torch: the driver plans and schedules without it, and an
    instance of a torch class exists only where unpickling it imported torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(error, torch.OutOfMemoryError)


def call_cause(error: BaseException) -> str | None:
    """The batch policy's reading of an exception a call raised: `infrastructure_cause`, except that an actor Ray
    is restarting (a probe's ActorUnavailableError) is RESTARTING, which costs a probe nothing."""
    if isinstance(error, ray.exceptions.ActorUnavailableError):
        return RESTARTING
    return infrastructure_cause(error)


def dead_nodes(node_ids: set[str]) -> set[str]:
    """Which of these Ray nodes the GCS lists as dead (`ray.nodes()`; an id it no longer lists counts as dead)."""
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    return {n for n in node_ids if n not in alive}


def describe_out_of_memory(error: BaseException, device) -> str:
    """`torch.OutOfMemoryError` on `device`, with the memory figures known there (render_service/memory.py)."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    figures = describe_device_memory(device)
    return f"{type(error).__name__} on {device}: {first_line[:400]}" + (f" [{figures}]" if figures else "")


__all__ = [
    "LOST_REFKV_ERRORS",
    "REQUEUE_CAUSES",
    "Cause",
    "dead_nodes",
    "describe_out_of_memory",
    "infrastructure_cause",
]
