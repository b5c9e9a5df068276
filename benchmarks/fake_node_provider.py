"""Ray's fake multi-node provider, with node types that offer `memory` as a cloud's node types do.

The job's workers ask Ray for `memory=` (docs/design.md#memory). On AWS or GCP the autoscaler fills each
node type's `memory` in from its instance type, and KubeRay from the pod's limits, so a pending worker's
request tells the autoscaler which node type fits it. Ray's fake_multinode provider has no instance types:
a node type that leaves `memory` out is one that no memory request fits, and the autoscaler never launches
it. Its own code cannot take `memory` in a node type either (it passes every resource other than CPU, GPU
and object_store_memory to RayParams as a custom resource, which RayParams refuses for `memory`).

`FakeNodesWithMemory` is that provider with two differences:
- a node type's `memory` becomes the launched raylet's `memory` (RayParams(memory=...)), so what the
  autoscaler plans with is what the node offers;
- a launched node starts no log monitor of its own. Every fake node writes its logs into the head's
  session folder (one machine), which the head's log monitor already follows; Ray's own advice is one
  log monitor per host. Each extra one polled that same folder ten times a second (3-4 % of a core
  apiece, more as worker log files pile up) and sent every worker line to the drivers once per node;
- a node whose raylet has died is no longer listed, as a cloud's API stops listing a machine that died.
  The parent keeps a killed node (benchmarks/fake_cluster.py `kill_node`) in its books as running, so the
  autoscaler counted it against `max_workers` and launched no replacement until its idle timeout took
  the dead node down: a job that lost its only rendering node waited 44 s for a new one
  (tests/cluster/test_node_loss.py, mid_batch). The scheduler sees the loss as before (the GCS's
  health check); only the replacement comes as soon as a cloud's would.

benchmarks/fake_cluster.py names it in the autoscaler config as an `external` provider.
"""

from __future__ import annotations

import threading
from typing import Any

import ray._private.parameter as ray_parameter
import ray._private.ray_constants as ray_constants
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

# The parent looks RayParams up in its module at each call; launches run on the autoscaler's threads.
_params_lock = threading.Lock()


class FakeNodesWithMemory(FakeMultiNodeProvider):
    def non_terminated_nodes(self, tag_filters):
        self._forget_dead_nodes()
        return super().non_terminated_nodes(tag_filters)

    def _forget_dead_nodes(self) -> None:
        """Drop the nodes whose raylet has exited, and end what is left of them (their agents)."""
        with self.lock:
            dead = [node_id for node_id, entry in self._nodes.items() if _raylet_exited(entry.get("node"))]
            for node_id in dead:
                self._terminate_node(self._nodes.pop(node_id))

    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels) -> None:
        memory = resources.get("memory")
        original = ray_parameter.RayParams

        def launched_node_params(**kwargs: Any) -> ray_parameter.RayParams:
            custom = {k: v for k, v in (kwargs.pop("resources") or {}).items() if k != "memory"}
            if memory is not None:
                kwargs["memory"] = int(memory)
            return original(resources=custom, include_log_monitor=False, **kwargs)

        with _params_lock:
            ray_parameter.RayParams = launched_node_params
            try:
                super()._create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
            finally:
                ray_parameter.RayParams = original


def _raylet_exited(node: Any) -> bool:
    """Whether a launched node's raylet process has exited (the head's entry holds no node)."""
    if node is None:
        return False
    raylets = node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])
    return bool(raylets) and all(info.process.poll() is not None for info in raylets)
