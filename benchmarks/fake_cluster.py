"""Real Ray clusters on one machine, started with `ray start` and stopped by PID.

- `RayHead`: a head node alone. The test session's local Ray is one (tests/ray_session.py): each test
  module connects its own driver to it, a job of its own (with a runtime environment only for what
  the head's processes lack: `job_runtime_env`).
- `FakeCluster`: a head plus Ray's autoscaler with its fake_multinode provider (as
  benchmarks/fake_node_provider.py extends it: node types offer `memory`, as a cloud's do). Every node the
  autoscaler launches is a real raylet with its own object store and resources (`GPU: 1` on a
  machine without GPUs), joined to the head. Objects fetched by an actor on another node travel
  between object stores; a node dies when its raylet is killed.

Each cluster is private to its object: its own temp dir and ports that nothing else uses, so tests
can run next to other Ray instances on the same machine. It is stopped by PID (every process whose
command line names its temp dir, plus the children of its raylets, which do not), never with
`ray stop`, which would kill every Ray on the machine.

    cluster = FakeCluster(max_gpu_nodes=3).start()
    with cluster.connected():           # ray.init(cluster.address) with token auth, then shutdown
        ...
    cluster.kill_node(node_id)          # SIGKILL one node's raylet
    cluster.stop()

Tests do not start their own: they take the session's shared cluster, `fake_cluster_module` or
`ray_session.fake_cluster(...)` (tests/conftest.py). `python -m benchmarks.fake_cluster` starts one to
try the README's cluster commands. Drivers in other processes (`ray job submit`, a CLI) get the
environment they need from `driver_env()`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from snapref_ray.models.device_memory import available_memory_bytes

REPO = Path(__file__).resolve().parents[1]

GPU_NODE_TYPE = "gpu"


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _free_ports(count: int) -> list[int]:
    """`count` distinct free ports: every socket stays bound until all are chosen, so the OS cannot hand the same
    port out twice (one at a time, a port released by the first call could come back from the second)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]


def _free_port_range(size: int, low: int = 20000, high: int = 32000) -> tuple[int, int]:
    """`size` consecutive free ports below the kernel's ephemeral range (32768+), so that no
    random port handed out later by the OS falls inside our worker range."""
    for _ in range(200):
        base = random.randrange(low, high - size)
        if all(_port_is_free(p) for p in range(base, base + size)):
            return base, base + size - 1
    raise RuntimeError(f"no {size} consecutive free ports in {low}-{high}")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _set_auth_mode(mode: str | None) -> None:
    """Switch this process's Ray auth mode. Ray reads RAY_AUTH_MODE into its C++ config once (at
    import or at a previous `ray.init`), so the config and the token cache are reloaded here, as
    Ray's own test helpers (`ray._private.authentication_test_utils`) do."""
    from ray._private.authentication_test_utils import reset_auth_token_state

    if mode is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = mode
    reset_auth_token_state()


def _alive(pid: int) -> bool:
    """Running (a zombie is dead already: only its parent or init can reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


class RayHead:
    """A Ray head node (`ray start --head`) with `num_cpus` logical CPUs, token authentication on.

    `object_store_bytes=None` leaves the object store at Ray's default size. `env` goes into the
    environment of the head's processes (and so of every worker) and into `driver_env()`.
    """

    def __init__(
        self,
        *,
        num_cpus: int = 8,
        object_store_bytes: int | None = None,
        dashboard: bool = False,
        env: dict[str, str] | None = None,
        keep_temp_dir: bool = False,
    ) -> None:
        self.num_cpus = num_cpus
        self.object_store_bytes = object_store_bytes
        self.dashboard = dashboard
        self.extra_env = dict(env or {})
        self.keep_temp_dir = keep_temp_dir  # Ray's logs are under it: keep them to debug a failure
        # Ray puts sockets under the temp dir: keep its path short (AF_UNIX paths are <108 bytes).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rfc-", dir="/tmp"))
        self.ip = ""
        self.port = 0
        self.dashboard_port = 0
        self._raylet_children: dict[int, set[int]] = {}
        self._processes_env: dict[str, str] = {}  # what the head's processes (and so every worker) inherit

    # -- addresses and environment ---------------------------------------------------------------
    @property
    def address(self) -> str:
        """GCS address for `ray.init(address)` and RAY_ADDRESS."""
        return f"{self.ip}:{self.port}"

    @property
    def dashboard_url(self) -> str:
        """Job-server address for `ray job submit --address` (only with `dashboard=True`)."""
        return f"http://{self.ip}:{self.dashboard_port}"

    def driver_env(self) -> dict[str, str]:
        """Environment for a driver process (pytest, a `ray job submit` CLI): token auth on, the
        project importable. Ray 2.60's `ray start` turns token authentication on; a driver without
        RAY_AUTH_MODE=token is refused with InvalidAuthToken."""
        pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        return {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "PYTHONPATH": pythonpath,
            "AWS_EC2_METADATA_DISABLED": "true",
            **self.extra_env,
        }

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout_s: float = 180.0) -> RayHead:
        import ray._private.services

        self.ip = ray._private.services.get_node_ip_address()
        (
            self.port,
            self.dashboard_port,
            client_port,
            node_manager_port,
            object_manager_port,
            metrics_port,
            runtime_env_port,
            agent_grpc_port,
            agent_listen_port,
        ) = _free_ports(9)
        worker_lo, worker_hi = _free_port_range(200)
        cmd = [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            f"--port={self.port}",
            f"--num-cpus={self.num_cpus}",
            "--num-gpus=0",
            f"--temp-dir={self.temp_dir}",
            f"--ray-client-server-port={client_port}",
            f"--min-worker-port={worker_lo}",
            f"--max-worker-port={worker_hi}",
            f"--node-manager-port={node_manager_port}",
            f"--object-manager-port={object_manager_port}",
            f"--metrics-export-port={metrics_port}",
            f"--runtime-env-agent-port={runtime_env_port}",
            f"--dashboard-agent-grpc-port={agent_grpc_port}",
            f"--dashboard-agent-listen-port={agent_listen_port}",
            "--disable-usage-stats",
            *self._autoscaler_args(),
        ]
        if self.object_store_bytes is not None:
            cmd.append(f"--object-store-memory={self.object_store_bytes}")
        if self.dashboard:
            cmd += ["--include-dashboard=true", "--dashboard-host=0.0.0.0", f"--dashboard-port={self.dashboard_port}"]
        else:
            cmd += ["--include-dashboard=false"]
        log = open(self.temp_dir / "ray-start.log", "wb")
        # `ray start` daemonises the head's processes and returns; they keep our temp dir in their
        # command lines, which is how stop() finds them.
        self._processes_env = self._start_env()
        proc = subprocess.run(cmd, env=self._processes_env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        if proc.returncode != 0:
            output = (self.temp_dir / "ray-start.log").read_text(errors="replace")[-3000:]  # stop() removes it
            self.stop()
            raise RuntimeError(f"ray start failed ({proc.returncode}): {output}")
        self._remember_children()
        return self

    def _autoscaler_args(self) -> list[str]:
        return []

    def _start_env(self) -> dict[str, str]:
        # Ray prestarts idle workers (two here) when the first driver connects: no test module's job
        # would use them (each is a driver of its own, and workers serve one job), so they only idled,
        # about 1 % of a core each, for the head's whole life.
        return {**self.driver_env(), "RAY_prestart_worker_first_driver": "0"}

    def job_runtime_env(self, env: dict[str, str] | None = None) -> dict | None:
        """The runtime environment a driver's job needs for its workers to see the project and `env`:
        only the variables the head's processes do not already have (workers inherit the raylet's
        environment), None when that is all of them.

        A job with a runtime environment starts each worker through Ray's `setup_worker.py`, a second
        Python start that imports Ray before the worker's own: 1.7 CPU-s against 1.0 for an empty
        actor on this machine. The project's PYTHONPATH is in the head's environment from its start,
        so most modules' jobs need none, as `snapref-ray render` sets none.
        """
        base = self.driver_env()
        wanted = {**{k: base[k] for k in ("PYTHONPATH", "AWS_EC2_METADATA_DISABLED", *self.extra_env)}, **(env or {})}
        missing = {k: v for k, v in wanted.items() if self._processes_env.get(k) != v}
        return {"env_vars": missing} if missing else None

    @contextlib.contextmanager
    def connected(self, env: dict[str, str] | None = None, *, log_to_driver: bool = False) -> Iterator[None]:
        """`ray.init` this process as a driver of the cluster: a job of its own, whose workers see the
        project on PYTHONPATH plus `env` (`job_runtime_env`); `ray.shutdown` after. The variables are
        the workers' only; callers that need them in this process set them here too."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        saved = os.environ.get("RAY_AUTH_MODE")
        _set_auth_mode("token")
        try:
            ray.init(address=self.address, log_to_driver=log_to_driver, runtime_env=self.job_runtime_env(env))
            yield
        finally:
            ray.shutdown()
            _set_auth_mode(saved)

    # -- processes ------------------------------------------------------------------------------
    def raylet_pids(self) -> dict[str, int]:
        """Ray node id (hex) -> raylet PID, for every live raylet of this cluster, head included."""
        out = {}
        for pid in self._own_pids():
            cmd = _cmdline(pid)
            if "/raylet " not in cmd and not cmd.split(" ", 1)[0].endswith("/raylet"):
                continue
            for arg in cmd.split():
                if arg.startswith("--node_id="):
                    out[arg.split("=", 1)[1]] = pid
        return out

    def log_monitor_pids(self) -> list[int]:
        """The live log monitors of this cluster: the head's alone, however many nodes run (one host, one
        logs folder; benchmarks/fake_node_provider.py)."""
        return sorted(pid for pid in self.pids() if "log_monitor.py" in _cmdline(pid))

    def _own_pids(self) -> list[int]:
        """Processes naming our temp dir, or our GCS address (the head's Ray Client server names
        only the address, and is re-parented to PID 1 when `ray start` exits)."""
        markers = [str(self.temp_dir)] + ([f"--address={self.address}"] if self.port else [])
        me = os.getpid()
        return [pid for pid in _all_pids() if pid != me and any(m in _cmdline(pid) for m in markers)]

    def _remember_children(self) -> None:
        """Workers and agents of our raylets do not name the temp dir and are re-parented to PID 1
        once their raylet dies: note them while the raylets are alive."""
        for pid in self.raylet_pids().values():
            self._raylet_children.setdefault(pid, set()).update(_children(pid))

    def pids(self) -> set[int]:
        """Every process of this cluster that is alive now (or was noted as one of its raylets' children)."""
        own = set(self._own_pids())
        for pid in list(own):
            own.update(_children(pid))
        for children in self._raylet_children.values():
            own.update(children)
        return {pid for pid in own if _alive(pid)}

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every process of this cluster, then SIGKILL what is left — by PID only."""
        self._remember_children()
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        # The monitor may have launched nodes after we listed; take a second look.
        for pid in pids | self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if not self.keep_temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


class FakeCluster(RayHead):
    """A head (no GPU) plus up to `max_gpu_nodes` autoscaled nodes with `GPU: 1` each.

    `cpus_per_node` is 1 (2-core machines). `head_cpus` may be 0 to keep every actor off the head,
    as a production head would be. Idle nodes go after `idle_timeout_minutes`: 1 minute, so that
    consecutive tests reuse the nodes the previous one brought up (the fake provider kills a node
    without draining it; an actor placed on it in the same second dies with it).

    A node that dies other than by the autoscaler's hand (`kill_node`) leaves the provider's books as
    soon as its raylet has exited (benchmarks/fake_node_provider.py), so the autoscaler replaces it within
    its next update. `set_gpu_node_limit(..., cold=True)` has the autoscaler terminate every GPU node.
    """

    def __init__(
        self,
        *,
        max_gpu_nodes: int = 3,
        cpus_per_node: int = 1,
        head_cpus: int = 1,
        object_store_bytes: int = 300_000_000,
        idle_timeout_minutes: float = 1.0,
        dashboard: bool = False,
        env: dict[str, str] | None = None,
        keep_temp_dir: bool = False,
        memory_per_node_bytes: int | None = None,
    ) -> None:
        super().__init__(
            num_cpus=head_cpus,
            object_store_bytes=object_store_bytes,
            dashboard=dashboard,
            env=env,
            keep_temp_dir=keep_temp_dir,
        )
        self.max_gpu_nodes = max_gpu_nodes
        self.cpus_per_node = cpus_per_node
        self.head_cpus = head_cpus
        self.idle_timeout_minutes = idle_timeout_minutes
        self.killed_nodes: set[str] = set()  # by kill_node, since the last cold start
        # What a raylet started here would find by itself (this machine's available memory less its object
        # store), declared in the node type so that the autoscaler can place workers that ask for `memory=`.
        self.memory_per_node_bytes = memory_per_node_bytes or available_memory_bytes("cpu") - object_store_bytes

    @property
    def _config_path(self) -> Path:
        return self.temp_dir / "autoscaler.json"

    def _autoscaler_args(self) -> list[str]:
        self._write_autoscaler_config()
        return [f"--autoscaling-config={self._config_path}"]

    # The GCS's node health check: a check each second, a node dead after 5 missed in a row. Ray's
    # defaults (every 3 s) leave a test waiting ~15 s after each kill before Ray reports the node lost;
    # the scheduler's handling of the loss is the same either way. A killed raylet refuses at once, so
    # it is found within ~5 s, while a live one would have to leave 5 checks of 3 s unanswered.
    HEALTH_CHECK = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "3000"}

    def _start_env(self) -> dict[str, str]:
        return {
            **super()._start_env(),
            "RAY_FAKE_CLUSTER": "1",
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            **self.HEALTH_CHECK,
        }

    def _write_autoscaler_config(self) -> None:
        """The autoscaler re-reads this file on every update (each second), so a new limit holds at once:
        it terminates the nodes above it (through the provider) and launches no more."""
        provider_limit = self.max_gpu_nodes
        gpu_resources = {
            "CPU": self.cpus_per_node,
            "GPU": 1,
            "object_store_memory": self.object_store_bytes,
            "memory": self.memory_per_node_bytes,  # as a cloud node type declares it (benchmarks/fake_node_provider.py)
        }
        config = {
            "cluster_name": f"fake-{self.temp_dir.name}",
            "max_workers": provider_limit,
            "provider": {
                "type": "external",
                "module": "benchmarks.fake_node_provider.FakeNodesWithMemory",
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
                "gcs_address": f"{self.ip}:{self.port}",
            },
            "available_node_types": {
                "ray.head.default": {"resources": {"CPU": self.head_cpus}, "node_config": {}, "max_workers": 0},
                GPU_NODE_TYPE: {
                    "resources": gpu_resources,
                    "node_config": {},
                    "min_workers": 0,
                    "max_workers": provider_limit,
                },
            },
            "head_node_type": "ray.head.default",
            "auth": {},
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": self.idle_timeout_minutes,
            "docker": {},
            "initialization_commands": [],
            "setup_commands": [],
            "head_setup_commands": [],
            "worker_setup_commands": [],
            "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
            "file_mounts": {},
            "cluster_synced_files": [],
            "file_mounts_sync_continuously": False,
            "rsync_exclude": [],
            "rsync_filter": [],
        }
        staged = self._config_path.with_suffix(".tmp")  # the autoscaler never reads half a file
        staged.write_text(json.dumps(config, indent=1))
        staged.replace(self._config_path)

    # -- nodes ----------------------------------------------------------------------------------
    def gpu_node_ids(self) -> list[str]:
        """Live autoscaled nodes (the fake provider names them fff...00001, 00002, ...)."""
        import ray

        return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0)

    def kill_node(self, node_id: str) -> int:
        """SIGKILL the raylet of one node (the whole node is lost: its workers and object store
        go with it, as when a machine dies). Returns the PID killed."""
        self._remember_children()
        pids = self.raylet_pids()
        if node_id not in pids:
            raise KeyError(f"no raylet for node {node_id} (live: {sorted(pids)})")
        pid = pids[node_id]
        children = _children(pid)
        os.kill(pid, signal.SIGKILL)
        for child in children:  # its workers would notice the raylet's death; do not wait for it
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        self.killed_nodes.add(node_id)
        return pid

    def wait_for_gpu_nodes(self, count: int, timeout_s: float = 180.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            nodes = self.gpu_node_ids()
            if len(nodes) >= count:
                return nodes
            time.sleep(1.0)
        raise TimeoutError(f"{count} GPU node(s) did not come up in {timeout_s:.0f} s")

    def set_gpu_node_limit(self, max_gpu_nodes: int, *, cold: bool = False, timeout_s: float = 120) -> None:
        """From now on the autoscaler keeps at most `max_gpu_nodes` GPU nodes; it terminates idle ones
        above the limit itself. `cold` first has it terminate every GPU node (the head alone, as
        after a fresh start). Needs a connected driver (`connected()`)."""
        if cold:
            self.max_gpu_nodes = 0
            self._write_autoscaler_config()
            self._wait_for_gpu_nodes_at_most(0, timeout_s)
            self.killed_nodes.clear()
        self.max_gpu_nodes = max_gpu_nodes
        self._write_autoscaler_config()
        self._wait_for_gpu_nodes_at_most(max_gpu_nodes, timeout_s)

    def _wait_for_gpu_nodes_at_most(self, count: int, timeout_s: float) -> None:
        """Until at most `count` GPU nodes are alive, nodes killed a moment ago (which the GCS still
        lists until it misses their heartbeats) not among them."""
        deadline = time.monotonic() + timeout_s
        while len(alive := self.gpu_node_ids()) > count or set(alive) & self.killed_nodes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"GPU nodes {alive} still alive after {timeout_s:.0f} s (wanted at most {count})")
            time.sleep(0.5)


@contextlib.contextmanager
def fake_cluster(**kwargs) -> Iterator[FakeCluster]:
    """A FakeCluster of its own (for scripts and benchmarks; tests share the session's), stopped after."""
    cluster = FakeCluster(**kwargs)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.fake_cluster`: a fake autoscaling cluster to try the README's cluster commands
    on one machine; prints its addresses and stops it (by PID) on Ctrl-C or SIGTERM."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--max-gpu-nodes", type=int, default=3)
    p.add_argument("--no-dashboard", action="store_true", help="no job server (`ray job submit` needs it)")
    args = p.parse_args(argv)

    def stop(signum, frame):  # `kill PID` (a background job ignores Ctrl-C) stops it cleanly too
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        # `ray start --head` (Ray 2.60) makes no token, and RayHead asks it for token auth: make the default one,
        # ~/.ray/auth_token, where drivers in other shells find it too (kept if it exists).
        subprocess.run(
            [sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"],
            stdout=subprocess.DEVNULL,
            check=True,
        )
    with fake_cluster(max_gpu_nodes=args.max_gpu_nodes, dashboard=not args.no_dashboard) as cluster:
        print(f"RAY_ADDRESS={cluster.address}  (for ray.init and snapref-ray render)")
        if not args.no_dashboard:
            print(f"job server: {cluster.dashboard_url}  (ray job submit --address ...)")
        print("drivers need RAY_AUTH_MODE=token; Ctrl-C stops the cluster", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
