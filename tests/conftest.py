"""Shared fixtures: the tiny model set (built once per session), the real key listings, the real
tokenizer files, S3, the session's Ray environments — and the rule that CI never skips.

What the tests need from outside the repository is only the real tokenizer files (they are not
ours to redistribute). They come from `SNAPREF_TOKENIZERS` (a folder holding `qwen/` and `t5/`) or
`SNAPREF_SHARED` (a folder holding `tokenizers/`); without either, the tests that need them skip
and say which variable to set. The real key/shape listings are small facts and live in
`tests/data/ref-keys/`.

`SNAPREF_NO_SKIP=1` (set by `.ci/run`) turns every skip — a missing Chromium, diffusers or
tokenizer folder, a `skipif`, an `importorskip` at module level — into a failure that carries the
skip's reason, so a CI run that passes has run every test.

Ray: one environment per kind for the whole session (tests/ray_session.py)
---------------------------------------------------------------------------
A test never calls `ray.init`, `start_local_serve` or `FakeCluster(...).start()` itself: starting Ray is
most of what these tests cost. It takes one of these fixtures (module scope), which start the
environment once per session and give the module its own job on it:

- `local_ray_job`: this process connected to the session's local Ray (8 logical CPUs, no GPU, the S3
  test server's AWS variables in its environment: `local_ray_environment`) for the module; yields the
  head (`.address`, `.driver_env()` for a driver in a subprocess).
  `local_ray(env, driver_env=True)` is the same as a context manager whose job (and, with
  `driver_env`, this process) also gets `env`, e.g. S3 credentials: tests/cluster/conftest.py.
- `local_serve`: the session's local Serve (HAProxy in front, 127.0.0.1). The module builds its
  ServeConfig with `port=local_serve.port` and deploys it with `local_serve.deployed(config)` (a
  context manager yielding the URL; the application is deleted after). Serve-wide settings are the
  session's: see `LocalServe`.
- `fake_cluster_module`: the session's fake multi-node cluster (a head with 2 CPUs and the
  dashboard, at most 3 one-CPU `GPU: 1` nodes), this process connected for the module.
  `shared_fake_cluster(max_gpu_nodes=..., cold=..., env=...)` is the same as a context manager
  with the module's own GPU-node limit, a cold start (no GPU node) or runtime environment. Kill
  nodes with `cluster.kill_node`: the next module then starts cold (the autoscaler would count a
  killed node against the limit for a minute), which costs it new nodes, so a module whose last
  test kills one is marked `pytest.mark.ray_order(1)` and runs after the others. Leave nothing
  running on the cluster (Serve shut down) at the module's end.

Two lanes, side by side (pytest-xdist, `-n 2 --dist loadgroup` in pyproject.toml)
---------------------------------------------------------------------------------
A driver is connected to one Ray at a time, so a process runs one environment at a time.
`pytest_collection_modifyitems` below puts each environment's modules together (local Ray, local
Serve, fake cluster; each module's tests in file order) and marks them with the environment's
lane (`XDIST_LANES` in tests/ray_session.py): the local Ray is one lane, the local Serve and then
the fake cluster the other. pytest-xdist gives each lane, whole, to one of its two workers, so each
environment starts once, in its lane's worker, while the other lane runs in the other; the modules
that need no environment fill the workers once their lanes are done. A test that starts its own
Ray (a subprocess, a benchmark's own `ray.init`) needs no fixture; the worker stops its lane's
environment before it (`pytest_runtest_setup`). `-n 0` runs everything in one process, in the same
order: the modules that need no environment first, then each environment's. The environments
started are printed at the end of the run, summed over the workers.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ray_session import ENVIRONMENTS, FAKE_CLUSTER, LOCAL_RAY, LOCAL_SERVE, XDIST_LANES, RaySession

pytest_plugins = ["tests.s3_server"]

# Inductor compiles in a pool of worker processes by default, one per core, each importing torch
# anew; for the tiny graphs of these tests on 2 cores the pool costs more than it saves
# (tests/models/test_compiled.py, cold cache: 66 s against 52 s with one thread). Set before any
# Ray starts, so the Ray workers and subprocesses of the session inherit it too.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Ray's usage statistics stay off in the tests: they would be reported to Ray's servers (the tests touch
# only 127.0.0.1), and Ray Data starts an actor just to collect them.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Each Ray head's log monitor re-lists its logs folder on every 0.1 s poll while it holds under this many
# files, and the session's heads hold hundreds (every worker leaves two); above it, every 0.5 s. New
# workers' lines still reach the drivers within half a second.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")

RAY_TOKEN_PATH_VAR = "RAY_AUTH_TOKEN_PATH"
MODEL_CACHE_VAR = "SNAPREF_RAY_CACHE"  # snapref_ray/storage/model_cache.py


def pytest_configure(config) -> None:
    _compile_the_project_once(config)
    _one_share_of_the_cores_per_worker(config)
    _session_ray_token(config)
    _session_model_cache(config)


def _compile_the_project_once(config) -> None:
    """Byte-compile the project's own modules once, in the controller, when Python is told not to write them.

    With PYTHONDONTWRITEBYTECODE set (as on the machines this suite runs on), no process writes a `.pyc`, so
    every process the suite starts compiled the project's sources again: each Ray render worker ~80 modules
    (0.09 CPU-s), each driver ~120 (0.15 CPU-s), a few hundred processes in a run. Python still reads `.pyc`
    files it finds, and `compileall` writes them whatever the variable says; up-to-date ones are left as they are.
    """
    import compileall
    import sys

    if hasattr(config, "workerinput") or not sys.dont_write_bytecode:
        return
    root = Path(__file__).resolve().parent.parent
    for package in ("snapref_ray", "benchmarks", "jobs", "tests"):
        compileall.compile_dir(root / package, quiet=1, workers=1)


def _one_share_of_the_cores_per_worker(config) -> None:
    """Each pytest-xdist worker's torch gets its share of the cores (`OMP_NUM_THREADS`), not all of them.

    torch's OpenMP threads spin after every parallel region waiting for more work, which only pays when
    they have the cores to themselves. With two workers on 2 cores, each with 2 threads, beside the Ray
    actors of the other lane, the spinning ate the other processes' time: tests/models/test_dit.py,
    test_fp8.py and test_vae.py took 34 CPU-s alone, 53 CPU-s beside two busy processes, and 33 CPU-s on
    one thread beside them (and less wall time: 60 s against 69 s).
    Set in the controller before the workers are spawned, so they inherit it, and with them every Ray
    head, actor and subprocess they start (Ray leaves a variable it finds set). A caller's value stays.
    """
    workers = getattr(config.option, "numprocesses", None)
    if hasattr(config, "workerinput") or not workers or "OMP_NUM_THREADS" in os.environ:
        return
    cores = os.cpu_count() or 1
    per_worker = 1 if not isinstance(workers, int) else max(1, cores // workers)  # "auto": a worker per core
    os.environ["OMP_NUM_THREADS"] = str(per_worker)
    config.add_cleanup(lambda: os.environ.pop("OMP_NUM_THREADS", None))


def _session_ray_token(config) -> None:
    """The session's Ray authentication token, in a file of its own named by RAY_AUTH_TOKEN_PATH.

    Ray 2.60's `ray start --head` creates no token, and the test heads start it with
    RAY_AUTH_MODE=token: on a machine without `~/.ray/auth_token` every test head failed to start
    ("Token authentication is enabled but no authentication token was found"), until some `ray.init`
    happened to write one.
    Made here, in the controller (or the only process, with `-n 0`) before any Ray starts or any
    pytest-xdist worker is spawned: the workers, every Ray process and every driver subprocess
    inherit the variable, so all of them use this one token. A token the caller already set is used.
    """
    if hasattr(config, "workerinput") or os.environ.get("RAY_AUTH_TOKEN") or os.environ.get(RAY_TOKEN_PATH_VAR):
        return
    token_file = _session_folder(config, "snapref-test-ray-token-", RAY_TOKEN_PATH_VAR) / "auth_token"
    token_file.write_text(secrets.token_hex(32))  # what Ray itself generates: 256 random bits as hex
    token_file.chmod(0o600)
    os.environ[RAY_TOKEN_PATH_VAR] = str(token_file)


def _session_model_cache(config) -> None:
    """The session's own model cache (`SNAPREF_RAY_CACHE`), so that no test writes into the user's
    `~/.cache/snapref-ray`: the fake cluster's nodes (started from a test process, with its environment)
    mirrored the README's s3:// model folder there in `test_readme_ray_job_submit_line`. The local Ray's
    processes get a cache of their own besides (`local_ray_environment`).
    Made in the controller before the workers are spawned, like the token above; a caller's value stays.
    """
    if hasattr(config, "workerinput") or os.environ.get(MODEL_CACHE_VAR):
        return
    os.environ[MODEL_CACHE_VAR] = str(_session_folder(config, "snapref-test-model-cache-", MODEL_CACHE_VAR))


def _session_folder(config, prefix: str, variable: str) -> Path:
    """A temporary folder for the session; at its end the folder is removed and `variable` (which the
    caller points into it) is unset."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    config.add_cleanup(lambda: (os.environ.pop(variable, None), shutil.rmtree(folder, ignore_errors=True)))
    return folder


DATA_DIR = Path(__file__).resolve().parent / "data"
REF_KEYS_DIR = DATA_DIR / "ref-keys"
NO_SKIP_VAR = "SNAPREF_NO_SKIP"


def _no_skip() -> bool:
    return os.environ.get(NO_SKIP_VAR, "").strip().lower() in {"1", "true", "yes"}


def _as_failure(report, what: str) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"{what} skipped, but {NO_SKIP_VAR}=1 forbids skips: {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if _no_skip() and report.skipped and not hasattr(report, "wasxfail"):
        _as_failure(report, item.nodeid)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if _no_skip() and report.skipped:  # a module-level importorskip / skip(allow_module_level=True)
        _as_failure(report, collector.nodeid or "collection")
    return report


def tokenizer_root() -> tuple[Path | None, str]:
    """(folder holding qwen/ and t5/, or None; where it came from) from the environment."""
    if os.environ.get("SNAPREF_TOKENIZERS"):
        return Path(os.environ["SNAPREF_TOKENIZERS"]), "SNAPREF_TOKENIZERS"
    if os.environ.get("SNAPREF_SHARED"):
        return Path(os.environ["SNAPREF_SHARED"]) / "tokenizers", "SNAPREF_SHARED/tokenizers"
    return None, ""


@pytest.fixture(scope="session")
def ref_keys_dir() -> Path:
    """The real key/shape listings (`key<TAB>shape` per line) of the released files."""
    return REF_KEYS_DIR


@pytest.fixture(scope="session")
def real_tokenizer_dirs() -> tuple[Path, Path]:
    """(qwen_dir, t5_dir) of the real tokenizer files; skips by name when none is configured."""
    root, source = tokenizer_root()
    if root is None:
        pytest.skip(
            "needs the real Qwen/T5 tokenizer files: set SNAPREF_TOKENIZERS=<folder with qwen/ and t5/>"
            " or SNAPREF_SHARED=<folder with tokenizers/>"
        )
    qwen, t5 = root / "qwen", root / "t5"
    missing = [str(p) for p in (qwen / "vocab.json", qwen / "merges.txt", t5 / "tokenizer.json") if not p.is_file()]
    if missing:  # a variable that points at the wrong place is a configuration error, not a skip
        pytest.fail(f"{source}={root}: real tokenizer files missing: {', '.join(missing)}")
    return qwen, t5


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """A complete tiny model set in the real file layouts (see snapref_ray/tiny.py)."""
    from snapref_ray.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def tiny_renderer(tiny_models: Path):
    from snapref_ray.engine import Renderer

    return Renderer.from_folder(tiny_models, device="cpu")


# ---------------------------------------------------------------------------------------------
# Ray: the session's environments (see the module docstring)

# The fixtures through which a test module uses each environment.
_ENVIRONMENT_FIXTURES = {
    LOCAL_RAY: {"local_ray", "local_ray_job"},
    LOCAL_SERVE: {"local_serve"},
    FAKE_CLUSTER: {"shared_fake_cluster", "fake_cluster_module"},
}
_SESSION: RaySession | None = None


@pytest.fixture(scope="session")
def ray_session() -> Iterator[RaySession]:
    """Starts each Ray environment once and stops the running one when another is needed."""
    global _SESSION
    _SESSION = RaySession()
    try:
        yield _SESSION
    finally:
        _SESSION.close()


@pytest.fixture(scope="session")
def local_ray_environment(s3_server, tmp_path_factory) -> dict[str, str]:
    """What the session's local Ray runs with, and so every worker of every job on it: the S3 test
    server as "AWS" (as a cluster node's environment holds its credentials) and a model cache of the
    session's own (s3:// model folders are mirrored there, not in the user's ~/.cache).

    In the head's environment rather than in each module's job: a job with a runtime environment
    starts every worker through Ray's `setup_worker.py`, a second Python start (benchmarks/fake_cluster.py
    `RayHead.job_runtime_env`)."""
    return {**s3_server.aws_environment(), "SNAPREF_RAY_CACHE": str(tmp_path_factory.mktemp("model-cache"))}


@pytest.fixture(scope="module")
def local_ray(ray_session: RaySession, local_ray_environment):
    """`local_ray(env=None, *, driver_env=False, log_to_driver=True)`: a context manager connecting
    this process to the session's local Ray as a job whose workers get `env` too (and, with
    `driver_env`, this process); yields the head."""
    ray_session.local_ray(local_ray_environment)
    return functools.partial(ray_session.local_job)


@pytest.fixture(scope="module")
def local_ray_job(local_ray):
    """This process connected to the session's local Ray for the module; yields the head."""
    with local_ray() as head:
        yield head


@pytest.fixture(scope="module")
def local_serve(ray_session: RaySession, s3_server):
    """The session's local Serve; its processes have the S3 test server's credentials in their
    environment, as a cluster node's would (configs carry none)."""
    return ray_session.local_serve(
        {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}
    )


@pytest.fixture(scope="module")
def shared_fake_cluster(ray_session: RaySession):
    """`shared_fake_cluster(*, max_gpu_nodes=3, cold=False, env=None, log_to_driver=False)`: a
    context manager connecting this process to the session's fake cluster; yields the FakeCluster."""
    return functools.partial(ray_session.fake_cluster)


@pytest.fixture(scope="module")
def fake_cluster_module(shared_fake_cluster):
    """The session's fake cluster (at most 3 GPU nodes), this process connected for the module."""
    with shared_fake_cluster() as cluster:
        yield cluster


def _environment_rank(item: pytest.Item) -> tuple[int, int]:
    """(environment, the module's `ray_order` mark) of a test; (0, 0) for one that needs none."""
    names = set(getattr(item, "fixturenames", ()))
    for rank, environment in enumerate(ENVIRONMENTS, start=1):
        if names & _ENVIRONMENT_FIXTURES[environment]:
            mark = item.get_closest_marker("ray_order")
            return rank, mark.args[0] if mark else 0
    return 0, 0


# Each test module's (environment, `ray_order`): the highest of its tests' (a module runs whole).
_MODULE_RANK: dict[Path, tuple[int, int]] = {}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the lane marks (it appends "@lane" to node ids)
def pytest_collection_modifyitems(config, items: list[pytest.Item]) -> None:
    """Modules that need no Ray environment first, then each environment's modules together, so
    that each environment starts once (within one, by `ray_order` mark, then file order); a
    module's tests keep their order. Each environment's modules are also marked with its lane
    (`xdist_group`): pytest-xdist hands a lane's tests to one worker, whole and in this order.

    The modules that need no environment go longest first (by their count of `slow` tests, then file
    order): pytest-xdist hands them out one test at a time to whichever worker is free once its lane is
    done, so the suite ends with short tests on both workers rather than one README block on one while
    the other idles. Simulated with the durations of a whole run (`--durations=0`, 2026-12-06): the two
    workers ended 39 s apart in file order and 3 s apart in this order."""
    first_seen: dict[Path, int] = {}
    slow_tests: Counter[Path] = Counter()
    for index, item in enumerate(items):
        _MODULE_RANK[item.path] = max(_MODULE_RANK.get(item.path, (0, 0)), _environment_rank(item))
        first_seen.setdefault(item.path, index)
        slow_tests[item.path] += item.get_closest_marker("slow") is not None

    def order(item: pytest.Item) -> tuple:
        rank = _MODULE_RANK[item.path]
        longest_first = -slow_tests[item.path] if rank[0] == 0 else 0
        return (rank, longest_first, first_seen[item.path])

    items.sort(key=order)
    for item in items:
        environment = _MODULE_RANK[item.path][0]
        if environment:
            item.add_marker(pytest.mark.xdist_group(XDIST_LANES[ENVIRONMENTS[environment - 1]]))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A module that needs no environment may start a Ray of its own (a benchmark's `ray.init`):
    under pytest-xdist it can follow a lane in the same worker, whose environment stops first.
    (By module: a test of an environment's module may use that module's fixtures without naming one.)"""
    if _SESSION is not None and _MODULE_RANK.get(item.path, (0, 0))[0] == 0:
        _SESSION.close()


def _environment_counts() -> dict[str, int]:
    counts = {f"{name} starts": n for name, n in _SESSION.starts.items()}
    return {**counts, "serve applications": _SESSION.serve_deployments}


def pytest_sessionfinish(session) -> None:
    """A pytest-xdist worker sends its environments' counts to the controller with its results."""
    if _SESSION is not None and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["ray_environments"] = _environment_counts()


_WORKER_COUNTS: list[dict[str, int]] = []


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook, called in the controller as each worker ends
def pytest_testnodedown(node, error) -> None:
    counts = getattr(node, "workeroutput", {}).get("ray_environments")
    if counts:
        _WORKER_COUNTS.append(counts)


def pytest_terminal_summary(terminalreporter) -> None:
    """How often each environment started (once per lane is the aim) and how many applications
    the local Serve deployed, summed over the workers."""
    counts = list(_WORKER_COUNTS) + ([_environment_counts()] if _SESSION is not None else [])
    if counts:
        total = {key: sum(c.get(key, 0) for c in counts) for key in counts[0]}
        terminalreporter.write_line("Ray environments: " + ", ".join(f"{k} {v}" for k, v in total.items()))
