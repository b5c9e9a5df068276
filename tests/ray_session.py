"""The Ray environments of one test session, each started once and shared by the modules that need it.

Starting Ray is most of what the Ray tests cost on 2 cores. Measured side by side: a module's own
local Ray 6.9 s against 1.3 s for a job on the shared one; its own Ray + Serve + application 17.7 s
against 9.3 s to deploy and delete the application on the shared Serve; its own fake cluster 14.8 s
(before any GPU node) against 1.5 s. So the session starts each of these environments once and
the modules take turns on it:

- "local_ray": a local head (`RayHead`, 8 logical CPUs, no GPU) whose processes have the session's
  S3 credentials and model cache in their environment (tests/conftest.py `local_ray_environment`).
  Each module connects its own driver, a job (with a runtime environment only for variables the head
  lacks: `RayHead.job_runtime_env`), and disconnects at its end; its actors and workers go with its job.
- "local_serve": Ray and Serve in this process, started by `serve_app.start_local_serve` as the
  server starts them (HAProxy in front, the direct-ingress environment on every Ray process, the S3
  test server's credentials in the environment as on a cluster node). Each module deploys its own
  application with its own ServeConfig (`LocalServe.deployed`) and deletes it at its end.
- "fake_cluster": a `FakeCluster` (a head with 2 CPUs and the dashboard, at most 3 one-CPU GPU
  nodes). Each module connects its own driver and sets the GPU-node limit it was written for.

A driver is connected to one Ray at a time, and the in-process Serve holds this process's
connection while it runs, so only one environment runs at a time in a process: asking for another
one stops the running one. tests/conftest.py orders the modules by environment and gives each
lane (`XDIST_LANES`: the local Ray in one, the local Serve then the fake cluster in the other) to one
pytest-xdist worker, so each starts once per session; a run that interleaves them (a plugin that
reorders tests) is still correct, only slower. The environments of the two lanes are private to
their workers (own ports and temp dirs) and run side by side.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from benchmarks.fake_cluster import FakeCluster, RayHead

LOCAL_RAY, LOCAL_SERVE, FAKE_CLUSTER = "local_ray", "local_serve", "fake_cluster"
# The order the environments run in; modules that need none run before all of them.
ENVIRONMENTS = (LOCAL_RAY, LOCAL_SERVE, FAKE_CLUSTER)
# pytest-xdist's lanes (`xdist_group`, tests/conftest.py): each runs whole in one worker, so its
# environments start once there, while the other worker runs the other lane at the same time.
# The local Serve shares the fake cluster's lane (Serve first, then the cluster, in that worker): summed per test
# (`--durations=0`, 2026-12-06, 1,413 tests) the local-Ray modules took 825 s, the local-Serve ones 235, the
# fake cluster's 343 and those that need no environment 452; with Serve in the local-Ray lane that lane alone
# (1,060 s) was the suite's 1,078 s while the other worker idled. The worker whose lane ends first goes on with
# the modules that need no environment.
XDIST_LANES = {LOCAL_RAY: "ray-local", LOCAL_SERVE: "ray-serve-cluster", FAKE_CLUSTER: "ray-serve-cluster"}

# The shared fake cluster: what every multi-node module of this suite fits in on 2 cores.
FAKE_CLUSTER_GPU_NODES = 3
FAKE_CLUSTER_HEAD_CPUS = 2


class LogMark:
    """What Ray's log files under `logs_dir` held when it was made: `since(pattern)` reads only
    what was written after, so that a module checks its own server's logs, not the session's."""

    def __init__(self, logs_dir: Path) -> None:
        self.logs_dir = logs_dir
        self._sizes = {p: p.stat().st_size for p in logs_dir.rglob("*") if p.is_file()}

    def since(self, pattern: str) -> str:
        """Text appended since the mark to the files matching `pattern` (relative to `logs_dir`)."""
        parts = []
        for path in sorted(self.logs_dir.glob(pattern)):
            with open(path, "rb") as f:
                f.seek(self._sizes.get(path, 0))
                parts.append(f.read().decode(errors="replace"))
        return "\n".join(parts)

    def files(self, pattern: str) -> list[Path]:
        """Files matching `pattern` that were written since the mark."""
        return [p for p in sorted(self.logs_dir.glob(pattern)) if p.stat().st_size > self._sizes.get(p, 0)]


class LocalServe:
    """Ray + Serve in this process on 127.0.0.1:`port`, as `snapref-ray serve` runs them.

    Serve-wide settings are the session's: HAProxy's environment, whose gRPC message limit
    (`grpc_limit`) is the default config's, and the proxy's timeout (`PROXY_TIMEOUT_S`). A module's
    config must fit in them; `deployed` checks that and says which field does not.
    """

    # Room for every config of the suite: the proxy times out after the longest request_timeout_s.
    PROXY_TIMEOUT_S = 310.0
    NUM_CPUS = 6

    def __init__(self, env: dict[str, str]) -> None:
        from snapref_ray.serve.config import ServeConfig
        from snapref_ray.serve.direct_ingress import free_port

        self.env = dict(env)
        self.port = free_port()
        # The config Serve itself starts from: only its host, port and proxy timeout are used.
        self._bootstrap = ServeConfig(
            model="(no application yet)", port=self.port, request_timeout_s=self.PROXY_TIMEOUT_S - 10.0
        )
        self.url = ""
        self.haproxy_dir: Path | None = None
        self.grpc_limit = 0
        self.deployments = 0  # applications deployed on it (reported at the end of the session)

    def start(self) -> LocalServe:
        from snapref_ray.serve import app as serve_app
        from snapref_ray.serve.direct_ingress import environment, grpc_message_limit

        # Without haproxy installed, Serve's own proxy answers (as for `snapref-ray serve`).
        with environment(self.env):  # Ray's processes inherit it when Ray starts
            self.url = serve_app.start_local_serve(self._bootstrap, num_cpus=self.NUM_CPUS)
        self.haproxy_dir = serve_app.haproxy_dir()
        self._haproxy_files = serve_app._haproxy_dir  # held here too: its folder goes when the last reference does
        self.grpc_limit = grpc_message_limit(self._bootstrap)
        return self

    def stop(self) -> None:
        from snapref_ray.serve import app as serve_app

        serve_app.stop_local(drain=False)  # the local Ray goes with it; nothing is in flight

    @property
    def logs_dir(self) -> Path:
        import ray

        return Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"

    @contextlib.contextmanager
    def deployed(self, config, name: str | None = None) -> Iterator[str]:
        """`config`'s application on this Serve at route "/" (every replica ready); deleted after.
        Yields the base URL. `config.port` must be `self.port`."""
        from ray import serve

        from snapref_ray.serve import app as serve_app

        name = name or serve_app.APP_NAME
        problems = []
        if config.port != self.port or config.host != "127.0.0.1":
            problems.append(
                f"host:port {config.host}:{config.port} (the session's Serve answers 127.0.0.1:{self.port})"
            )
        if config.proxy_timeout_s() > self.PROXY_TIMEOUT_S:
            problems.append(f"request_timeout_s={config.request_timeout_s} (at most {self.PROXY_TIMEOUT_S - 10.0})")
        from snapref_ray.serve.direct_ingress import grpc_message_limit

        if grpc_message_limit(config) > self.grpc_limit:
            problems.append(f"limits {config.limits} need gRPC messages over the session's {self.grpc_limit} bytes")
        if problems:
            raise ValueError("this ServeConfig does not fit the session's local Serve: " + "; ".join(problems))
        serve_app.deploy_local(config, name=name)
        self.deployments += 1
        try:
            yield self.url
        finally:
            serve.delete(name)


class RaySession:
    """Starts each environment on first use and stops the running one when another is asked for."""

    def __init__(self) -> None:
        self._name: str | None = None
        self._running: RayHead | LocalServe | None = None
        self._local_ray_env: dict[str, str] = {}  # what the local head runs with, from its first request
        self.starts: dict[str, int] = dict.fromkeys(ENVIRONMENTS, 0)  # reported at the end of the session
        self.serve_deployments = 0

    def _switch(self, name: str, start) -> object:
        if self._name == name and self._running is not None:
            return self._running
        self.close()
        self._running = start()
        self._name = name
        self.starts[name] += 1
        return self._running

    def close(self) -> None:
        """Stop whatever environment runs."""
        running, self._running, self._name = self._running, None, None
        if isinstance(running, LocalServe):
            self.serve_deployments += running.deployments
        if running is not None:
            running.stop()

    # -- the environments -----------------------------------------------------------------------
    def local_ray(self, env: dict[str, str] | None = None) -> RayHead:
        """The session's local head, started (with `env` in its processes' environment, or the env it
        was first asked with) if it is not running."""
        if env is not None:
            if self._local_ray_env and env != self._local_ray_env:
                raise RuntimeError("the session's local Ray runs with another environment; one per session")
            self._local_ray_env = dict(env)
        return self._switch(LOCAL_RAY, lambda: RayHead(num_cpus=8, env=self._local_ray_env).start())

    @contextlib.contextmanager
    def local_job(self, env: dict[str, str] | None = None, *, driver_env: bool = False, log_to_driver: bool = True):
        """This process connected to the local head as a job whose workers also get `env`; with
        `driver_env`, `env` is in this process's environment too (restored after). Yields the head."""
        head = self.local_ray()
        saved = {k: os.environ.get(k) for k in (env or {})} if driver_env else {}
        try:
            if driver_env:
                os.environ.update(env or {})
            with head.connected(env, log_to_driver=log_to_driver):
                yield head
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def local_serve(self, env: dict[str, str]) -> LocalServe:
        """The session's local Serve (started with `env` in its processes' environment if it is not running)."""
        serve = self._switch(LOCAL_SERVE, lambda: LocalServe(env).start())
        if serve.env != env:
            raise RuntimeError("the session's local Serve runs with another environment; one Serve per session")
        return serve

    @contextlib.contextmanager
    def fake_cluster(
        self,
        *,
        max_gpu_nodes: int = FAKE_CLUSTER_GPU_NODES,
        cold: bool = False,
        env: dict[str, str] | None = None,
        log_to_driver: bool = False,
    ) -> Iterator[FakeCluster]:
        """This process connected to the session's fake cluster as a job whose workers also get
        `env`; the autoscaler keeps at most `max_gpu_nodes` GPU nodes meanwhile (it terminates idle
        ones above it), and `cold` has it terminate every GPU node first (the head alone). After a
        module that killed nodes the next one starts cold too: each gets the capacity it asks for."""
        if max_gpu_nodes > FAKE_CLUSTER_GPU_NODES:
            raise ValueError(f"the shared fake cluster has at most {FAKE_CLUSTER_GPU_NODES} GPU nodes (2 cores)")
        cluster = self._switch(
            FAKE_CLUSTER,
            lambda: FakeCluster(
                max_gpu_nodes=FAKE_CLUSTER_GPU_NODES, head_cpus=FAKE_CLUSTER_HEAD_CPUS, dashboard=True
            ).start(),
        )
        with cluster.connected(env, log_to_driver=log_to_driver):
            cluster.set_gpu_node_limit(max_gpu_nodes, cold=cold)
            yield cluster
