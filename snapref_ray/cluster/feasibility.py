"""A render worker that no node type of the cluster can hold: found from Ray's own report, told in one line.

An actor whose request (`num_gpus`, `num_cpus`, `memory=`) fits no node is *infeasible*: it stays pending for
ever. On an autoscaling cluster Ray's autoscaler says so, every 30 s, to every driver ("No available node types
can fulfill resource request {'memory': 3222315440.0, 'GPU': 1.0, 'CPU': 1.0}"); without this module the job
waited its whole `cluster.start_timeout_s` (900 s) before failing with a guess. `InfeasibilityWatch` listens
for that report (ray_console.py passes the autoscaler's lines on), and the pool (cluster/pool.py) asks it
while no worker has started yet: the first report about the workers' own request ends the job within a minute
of asking, with `WorkerCannotBePlaced` naming what a worker asks for, what each node type offers (read from
the autoscaler's cluster config on this machine, else the nodes that are up) and what to change.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import threading
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

_REPORT = re.compile(r"No available node types can fulfill resource requests? (?P<requests>.*)")
_DICT = re.compile(r"\{[^{}]*\}")
_GIB = 2**30


class WorkerCannotBePlaced(ValueError):
    """No node type of the cluster can hold one render worker's resource request (a usage error: exit status 2)."""


def infeasible_requests(line: str) -> list[dict[str, float]]:
    """The resource requests an autoscaler report line calls infeasible ([] for any other line).

    Both autoscalers' wordings: v1's "Error: No available node types can fulfill resource request {...}. Add
    suitable node types ..." and v2's "No available node types can fulfill resource requests {...}*1, {...}*2."
    """
    match = _REPORT.search(line)
    if not match:
        return []
    found = []
    for text in _DICT.findall(match.group("requests")):
        try:
            request = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            continue
        if isinstance(request, dict):
            found.append({str(k): float(v) for k, v in request.items()})
    return found


def is_this_request(reported: Mapping[str, float], asked: Mapping[str, float]) -> bool:
    """Whether a reported request is the workers' own: the same resources in the same amounts (Ray reports the
    request as the actor made it; memory in bytes, as floats)."""
    asked = {k: float(v) for k, v in asked.items() if v}
    reported = {k: float(v) for k, v in reported.items() if v}
    return asked.keys() == reported.keys() and all(
        abs(reported[k] - asked[k]) <= 1e-6 * max(1.0, asked[k]) for k in asked
    )


def short_resources(asked: Mapping[str, float], offers: Mapping[str, Mapping[str, float]]) -> list[str]:
    """The resources of `asked` that no single offer has enough of (those to change first); [] when each is
    offered somewhere (then it is the combination no one node type has)."""
    return [r for r, amount in asked.items() if amount and not any(o.get(r, 0) >= amount for o in offers.values())]


def explain(asked: Mapping[str, float], offers: Mapping[str, Mapping[str, float]], *, source: str) -> str:
    """The one-line reason: what a worker asks for, what each node type offers (`source` says where that came
    from), the resource at fault and the settings that change it."""
    short = short_resources(asked, offers)
    shown = "; ".join(f"{name}: {_resources(offer)}" for name, offer in offers.items()) or "none"
    fault = f"no node type has enough {', '.join(short)}" if short else "no one node type has all of it together"
    advice = []
    if "memory" in short or not short:
        advice.append("lower cluster.memory_per_worker (or max_batch, or the image size)")
    if "GPU" in short:
        advice.append("add a GPU node type, or set model.device: cpu")
    if "CPU" in short:
        advice.append("lower cluster.num_cpus_per_worker")
    advice.append("or give the cluster a node type that holds it (docs/clusters.md)")
    return (
        f"a render worker can never start: it asks Ray for {_resources(asked)} and {fault} "
        f"(Ray's autoscaler: no available node type can fulfill it); {source}: {shown}; " + ", ".join(advice)
    )


def _resources(resources: Mapping[str, float]) -> str:
    parts = []
    for name in sorted(resources, key=lambda n: (n not in ("CPU", "GPU", "memory"), n)):
        value = resources[name]
        if name in ("memory", "object_store_memory"):
            parts.append(f"{name} {value / _GIB:.2f} GiB")
        elif not name.startswith("node:"):
            parts.append(f"{name} {value:g}")
    return ", ".join(parts) or "nothing"


def node_type_offers(config: Mapping) -> dict[str, dict[str, float]]:
    """Resources per node type of an autoscaler cluster config (`available_node_types`)."""
    types = config.get("available_node_types") or {}
    return {name: {k: float(v) for k, v in (t.get("resources") or {}).items()} for name, t in types.items()}


def cluster_offers() -> tuple[dict[str, dict[str, float]], str]:
    """(offers by name, where they come from): the node types of the autoscaler's cluster config when this
    machine runs the autoscaler (the head, where `ray job submit` runs the driver), else the nodes up now."""
    config = _autoscaler_config()
    if config:
        offers = node_type_offers(config)
        if offers:
            return offers, "the node types offer"
    import ray

    nodes = {
        f"node {n['NodeID'][:8]}": {k: v for k, v in n["Resources"].items() if not k.startswith("node:")}
        for n in ray.nodes()
        if n.get("Alive")
    }
    return nodes, "the nodes up now offer"


def _autoscaler_config() -> dict | None:
    """The cluster config the autoscaler of the connected cluster reads (its `--autoscaling-config` file), when it
    runs on this machine; None otherwise. Other Rays on the machine have monitors of their own: the one whose
    `--gcs-address` is ours."""
    try:
        import psutil
        import ray
    except ImportError:
        return None
    ours = f"--gcs-address={ray.get_runtime_context().gcs_address}"
    for process in psutil.process_iter(["cmdline"]):
        args = process.info.get("cmdline") or []
        if not any("monitor.py" in a for a in args[:3]) or ours not in args:
            continue
        for i, arg in enumerate(args):
            path = arg.split("=", 1)[1] if arg.startswith("--autoscaling-config=") else None
            if arg == "--autoscaling-config" and i + 1 < len(args):
                path = args[i + 1]
            if path:
                return _load_config(Path(path))
    return None


def _load_config(path: Path) -> dict | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        return json.loads(text)
    except ValueError:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            return None
        return data if isinstance(data, dict) else None


class InfeasibilityWatch:
    """Listens for Ray's infeasible-request reports about one worker request until `stop()`.

    `check()` raises WorkerCannotBePlaced once a report about `asked` came in; the pool calls it each time the
    scheduler waits for starting workers, until one has started.
    """

    def __init__(self, asked: Mapping[str, float]) -> None:
        from snapref_ray import ray_console

        self.asked = {k: float(v) for k, v in asked.items() if v}
        self._report: str | None = None
        self._lock = threading.Lock()
        self._stop = ray_console.on_autoscaler_line(self.feed)

    def feed(self, line: str) -> None:
        """One line of the autoscaler's output (ray_console calls it on Ray's log thread)."""
        if any(is_this_request(r, self.asked) for r in infeasible_requests(line)):
            with self._lock:
                self._report = line.strip()

    def check(self) -> None:
        with self._lock:
            report = self._report
        if report is None:
            return
        self.stop()
        offers, source = cluster_offers()
        log.info("Ray's autoscaler: %s", report)  # job.log; the exception is the terminal's line
        raise WorkerCannotBePlaced(explain(self.asked, offers, source=source))

    def stop(self) -> None:
        self._stop()
