"""What a render call's error means for its items (cluster/failures.py), on real `ray.exceptions` instances built
the way Ray builds them (a user-code error arrives as `RayTaskError(...).as_instanceof_cause()`). No Ray runtime
is needed: classification reads exception classes only."""

from __future__ import annotations

import pytest
import ray
import torch
from ray.core.generated.common_pb2 import ActorDiedErrorContext, NodeDeathInfo

from snapref_ray.cluster.failures import LOST_REFKV_ERRORS, Cause, infrastructure_cause

E = ray.exceptions
OBJECT = "ab" * 14


def _raised_in_user_code(cause: BaseException) -> BaseException:
    """What `ray.get` raises when the actor method's own code raised `cause`."""
    return E.RayTaskError("RenderWorker.render", "Traceback (most recent call last): ...", cause).as_instanceof_cause()


def _preempted() -> E.ActorDiedError:
    context = ActorDiedErrorContext(
        actor_id=b"\x01" * 16, node_death_info=NodeDeathInfo(reason=NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED)
    )
    return E.ActorDiedError(context)


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (E.ActorDiedError(), Cause.WORKER_LOST),
        (E.ActorUnavailableError("failed to connect to all addresses", None), Cause.WORKER_LOST),
        (E.WorkerCrashedError(), Cause.WORKER_LOST),
        (E.NodeDiedError("the node died"), Cause.WORKER_LOST),  # settled later from ray.nodes()
        (E.LocalRayletDiedError(), Cause.WORKER_LOST),
        (E.ObjectLostError(OBJECT, None, ""), Cause.WORKER_LOST),  # the call's return, lost with its node
        (_preempted(), Cause.NODE_LOST),  # the autoscaler drained the node: known at once
        (E.OutOfMemoryError("Task was killed due to the node running low on memory."), Cause.OOM_KILLED),
        (_raised_in_user_code(E.OutOfMemoryError("raised as such")), Cause.OOM_KILLED),
        (_raised_in_user_code(torch.OutOfMemoryError("CUDA out of memory.")), Cause.DEVICE_OOM),
        (E.TaskCancelledError(), Cause.RELEASED),
        (_raised_in_user_code(ValueError("a bad latent")), None),  # the item's own: an attempt
        (_raised_in_user_code(FloatingPointError("NaN")), None),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_a_render_calls_error_is_the_clusters_or_the_items(error, cause):
    assert infrastructure_cause(error) == cause


def test_lost_refkv_errors_are_the_object_and_actor_families_and_a_timeout():
    for error in (
        E.ObjectLostError(OBJECT, None, ""),
        E.OwnerDiedError(OBJECT, None, ""),
        E.ObjectFetchTimedOutError(OBJECT, None, ""),
        E.ObjectFreedError(OBJECT, None, ""),
        E.ObjectReconstructionFailedError(OBJECT),
        E.ReferenceCountingAssertionError(OBJECT, None, ""),
        E.ActorDiedError(),
        E.ActorUnavailableError("restarting", None),
        E.GetTimeoutError(),
    ):
        assert isinstance(error, LOST_REFKV_ERRORS), type(error).__name__
    # The task that made the object raised: not a lost object (encoding here would raise the same).
    assert not isinstance(_raised_in_user_code(ValueError("unreadable reference")), LOST_REFKV_ERRORS)
