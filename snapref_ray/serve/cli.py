"""`snapref-ray serve`: the HTTP endpoint on a local Ray (tiny models work).

The lead's snapref_ray/cli.py registers it with `add_serve_parser(sub)`. On a cluster, use
serve.yaml with `serve deploy` instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import tempfile
import time

from pydantic import SecretStr

from snapref_ray.cli_flags import add_model_flags, model_spec_from
from snapref_ray.model_spec import ModelSpec
from snapref_ray.serve.config import TOKEN_ENV, ServeConfig
from snapref_ray.uris import base_of


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve` on the main parser's subcommands."""
    p = sub.add_parser(
        "serve",
        help="run the HTTP API (Ray Serve) on a local Ray",
        description="Serve SnapRef renders over HTTP: POST /v1/references, POST /v1/render,"
        " GET /v1/health, GET /v1/models; OpenAPI docs at /docs.",
    )
    # No argparse defaults: a flag left out keeps --config's value, else the ServeConfig default.
    p.add_argument("--host", help="bind address (default 127.0.0.1; any other needs a token)")
    p.add_argument("--port", type=int, help="port to answer on (default 8000; refused when something listens there)")
    p.add_argument("--token", help=f"bearer token clients must send (default: ${TOKEN_ENV})")
    p.add_argument(
        "--config", help="JSON or YAML file of ServeConfig fields (model, limits, replicas, batching); flags win"
    )
    p.add_argument(
        "--log",
        metavar="FILE",
        help="where Ray's and Serve's own lines go, appended (default: snapref-ray-serve-PORT.log in the temporary"
        " folder); the terminal keeps the server's lines, warnings and errors",
    )
    add_model_flags(p)
    p.set_defaults(func=cmd_serve)
    return p


def log_path(args: argparse.Namespace, port: int) -> str:
    """--log, else snapref-ray-serve-PORT.log in the temporary folder (one per port: two servers never mix lines)."""
    return args.log or os.path.join(tempfile.gettempdir(), f"snapref-ray-serve-{port}.log")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of the flags (over --config's file); the token from --token or the environment."""
    from snapref_ray.job_spec import read_yaml_mapping, validate_spec

    # YAML reads JSON too; a missing file, a parse error or a bad field is one line naming the file.
    values: dict = read_yaml_mapping(args.config, what="serve config") if args.config else {}
    values.update({name: getattr(args, name) for name in ("host", "port") if getattr(args, name) is not None})
    if values.get("model") is None and args.model_models_dir is None:
        raise ValueError("give --models DIR (or `model:` in --config's file)")
    base = None
    if values.get("model") is not None:  # relative paths in the file are relative to the file
        base = ModelSpec.model_validate(values["model"]).resolve_paths(base_of(os.path.abspath(args.config)))
    values["model"] = model_spec_from(args, base).resolve_paths(os.getcwd())
    config = validate_spec(values, ServeConfig, args.config or "command line", what="serve config")
    # Resolved here, in the process that read the environment, so every replica gets the same token.
    token = args.token or config.resolved_token()
    return config.model_copy(update={"token": SecretStr(token)}) if token else config


def cmd_serve(args: argparse.Namespace) -> int:
    from snapref_ray.ray_console import ray_start_failures_in_one_line, serve_console
    from snapref_ray.serve import app  # noqa: F401  (Ray Serve sets its logger up on import: before ours)

    config = config_from_args(args)
    config.check_security()
    check_model_files(config)  # else every replica fails to load it, in pages of nested tracebacks
    check_port_free(config.host, config.port)  # else Serve fails deep inside Ray, with four tracebacks
    stop = StopRequest()
    stop.on_signals()
    # Ray's and Serve's lines (~50 of them at start, warnings meant for a multi-node cluster among them) go to the
    # log; the terminal keeps the line that says where the server answers, and errors.
    with serve_console(log_path(args, config.port), verbose=args.verbose) as log_file, ray_start_failures_in_one_line():
        return _serve_until_stopped(config, stop, log_file)


def _serve_until_stopped(config: ServeConfig, stop: StopRequest, log_file: str) -> int:
    from snapref_ray.serve.app import deploy_local, http_front, local_topology, start_local_serve, stop_local
    from snapref_ray.serve.direct_ingress import haproxy_binary

    url = start_local_serve(config)  # where it fails, the Ray it started stops with serve_console
    try:
        # `ray.init` puts its own SIGTERM handling in place (a SystemExit, and a stack dump and abort from its
        # core worker): a `kill` then ended the server with exit 134 while its replicas were still draining.
        # Ours again, before the replicas start: a stop asked for while they load drains once they are up.
        stop.on_signals()
        deploy_local(config)
        auth = "bearer token required" if config.resolved_token() else "no token (loopback only)"
        front = (
            f"HAProxy -> ingress (direct ingress; {haproxy_binary()})"
            if http_front() == "haproxy"
            else "Serve's proxy -> ingress"
        )
        front += " that renders" if local_topology() == "fused" else " -> renderers"
        print(f"serving on {url} ({auth}; {front}); API docs at {url}/docs; log: {log_file}; Ctrl-C stops", flush=True)
        stop.wait()
    finally:
        print("stopping: replicas finish what they hold", flush=True)
        stop_local()
    return 0


def check_model_files(config: ServeConfig) -> None:
    """The check `render`'s driver makes before any worker starts (jobs/run_preview.py): the model folder, its files
    and the LoRAs are found, and the adapter's header is read (ModelFilesError, StorageError: one line, exit 2)."""
    from snapref_ray.render_service.loading import adapter_kind, check_named_files

    check_named_files(config.model, s3=config.s3_options())
    adapter_kind(config.model, s3=config.s3_options())


class PortInUse(ValueError):
    """Something already listens on the port the server was asked to answer (a usage error: exit status 2)."""


def check_port_free(host: str, port: int) -> None:
    """PortInUse when a socket listens on host:port. A port whose old connections linger (TIME_WAIT) counts as
    free, as it does for the server, which binds with SO_REUSEADDR too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise PortInUse(
                f"port {port} on {host} is in use ({e.strerror or e}): another server listens there;"
                " stop it, or choose another --port"
            ) from None


class StopRequest:
    """Ctrl-C and SIGTERM (`kill`, a container's stop) ask the server to drain and stop.

    The handler only sets a flag, and the main thread looks at it between short sleeps. A handler that takes a
    lock (`threading.Event.set`) deadlocks when a second signal arrives while the first holds it: Python runs
    the second handler inside the first, on the same thread. Two Ctrl-Cs, or a `timeout` that forwards its own
    signal beside the terminal's, left the server hung before it drained.
    """

    POLL_S = 0.2

    def __init__(self) -> None:
        self.asked = False

    def on_signals(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._ask)

    def _ask(self, signum: int, frame: object) -> None:
        self.asked = True

    def wait(self) -> None:
        while not self.asked:
            time.sleep(self.POLL_S)
