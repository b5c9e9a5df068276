"""The front door's mistakes, each one `error:` line and exit status 2 within seconds, before Ray or Serve start
where they can be known then: a model folder that does not exist (`serve` as `render`), S3 without credentials or
on an endpoint that does not answer (`render`, `render --dry-run`), a local output that is a file, a LoRA file that
does not exist, a local Ray whose start times out, a mistyped flag (with the closest flag of its subcommand),
`--compile-cache` where nothing compiles.

Each runs the real command line in a subprocess (tests/test_cli_exit_codes.py `snapref`, which also asserts that
no traceback is printed). None starts a Ray: RAY_ADDRESS is unset, and the mistakes are found before Ray would
start, or (the start that times out) Ray's own start-up timeout is raised where Ray raises it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from snapref_ray.serve.direct_ingress import free_port
from tests.test_cli_exit_codes import EXAMPLES, REPO, _env, error_lines, snapref

MANIFEST = str(EXAMPLES / "example_manifest.csv")
# What Ray 2.60 prints when it starts, had it started.
RAY_STARTED = "Started a local Ray instance"


def test_serve_with_a_model_folder_that_does_not_exist_is_one_line_before_ray(tmp_path):
    """The same line as `render`'s (the same check: render_service/loading.py `adapter_kind`)."""
    missing = tmp_path / "tinyy"
    status, out = snapref("serve", "--models", "tinyy", "--port", str(free_port()), cwd=tmp_path)
    assert status == 2, out
    assert error_lines(out) == [
        f"error: model folder {missing} does not exist (make a tiny set with `snapref-ray make-tiny {missing}`)"
    ]
    assert RAY_STARTED not in out and "serving on" not in out


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "render"])
def test_a_local_output_that_is_a_file_is_one_line_before_ray(tiny_models, tmp_path, dry_run):
    """The run once stopped at its log file with "[Errno 17] File exists" (exit 2, no word of the output), and the
    dry run said the output was new."""
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    for out, says in ((taken, "is a file"), (taken / "sub", f"is under {taken}, a file")):
        status, printed = snapref(
            "render", MANIFEST, "--models", str(tiny_models), "--out", str(out), *(["--dry-run"] if dry_run else [])
        )
        assert status == 2, printed
        assert error_lines(printed) == [f"error: output {out} {says}: give a folder (or s3://bucket/prefix)"]
        assert RAY_STARTED not in printed and taken.read_text() == "not a folder"
    # The demo writes the same two kinds of folder.
    status, printed = snapref("demo", "--out", str(taken), "--models", str(tmp_path / "tiny"))
    assert status == 2 and error_lines(printed) == [
        f"error: output {taken} is a file: give a folder (or s3://bucket/prefix)"
    ], printed
    status, printed = snapref("demo", "--out", str(tmp_path / "demo"), "--models", str(taken))
    assert status == 2 and error_lines(printed) == [f"error: models folder {taken} is a file: give a folder"], printed


@pytest.mark.parametrize("command", ["render", "render --dry-run", "serve"])
def test_a_lora_file_that_does_not_exist_is_one_line_before_ray(tiny_models, tmp_path, command):
    """A missing LoRA once started Ray and four render workers, each failing to load it, and ended in a traceback
    (exit 1); `--dry-run` called the job fine."""
    missing = tmp_path / "styel.safetensors"
    args = (
        ["serve", "--models", str(tiny_models), "--port", str(free_port())]
        if command == "serve"
        else [*command.split(), MANIFEST, "--models", str(tiny_models), "--out", str(tmp_path / "out")]
    )
    status, printed = snapref(*args, "--lora", f"{missing}:0.5", cwd=tmp_path)
    assert status == 2, printed
    assert error_lines(printed) == [f"error: LoRA file {missing} does not exist"]
    assert RAY_STARTED not in printed
    if command == "render --dry-run":
        assert not (tmp_path / "out").exists()  # a run makes the output's folder for its job.log first


def test_a_file_given_as_a_lora_that_is_none_is_one_line_before_ray(tiny_models, tmp_path):
    """The DiT given as a LoRA: the engine's own refusal (models/lora_keys.py `group_lora_keys`) from the file's
    header, before any worker tries to load it."""
    dit = tiny_models / "dit.safetensors"
    status, printed = snapref(
        "render", MANIFEST, "--models", str(tiny_models), "--out", str(tmp_path / "out"), "--lora", f"{dit}:0.5"
    )
    assert status == 2, printed
    [line] = error_lines(printed)
    assert line.startswith(f"error: LoRA file {dit}: ") and "are not LoRA weights of an Anima DiT linear" in line
    assert RAY_STARTED not in printed


def _aws_env(**aws: str) -> dict[str, str]:
    """The command's environment with only the AWS settings given: no credentials from this machine's environment,
    files or instance metadata."""
    env = {k: v for k, v in _env().items() if not k.startswith("AWS_")}
    return {
        **env,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_REGION": "us-east-1",
        **aws,
    }


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "render"])
def test_s3_output_without_credentials_is_one_line(s3_server, tiny_models, dry_run):
    prefix = f"no-credentials-{'dry' if dry_run else 'run'}"
    out_uri = f"s3://{s3_server.bucket}/{prefix}"
    status, out = snapref(
        "render", MANIFEST, "--models", str(tiny_models), "--out", out_uri, *(["--dry-run"] if dry_run else []),
        env=_aws_env(AWS_ENDPOINT_URL=s3_server.endpoint_url),
    )  # fmt: skip
    assert status == 2, out
    assert error_lines(out) == [
        f"error: no S3 credentials for {out_uri} (Unable to locate credentials): set AWS_ACCESS_KEY_ID and"
        " AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or run where an instance role provides them"
    ]
    assert RAY_STARTED not in out
    assert "Contents" not in s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix)


def test_s3_credentials_the_store_refuses_are_one_line(s3_server, tiny_models):
    out_uri = f"s3://{s3_server.bucket}/refused"
    env = _aws_env(AWS_ENDPOINT_URL=s3_server.endpoint_url, AWS_ACCESS_KEY_ID="nobody", AWS_SECRET_ACCESS_KEY="x")
    status, out = snapref("render", MANIFEST, "--models", str(tiny_models), "--out", out_uri, "--dry-run", env=env)
    assert status == 2, out
    assert error_lines(out) == [
        f"error: the S3 endpoint {s3_server.endpoint_url} refused the credentials for {out_uri} (InvalidAccessKeyId):"
        " set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or run where an instance role provides"
        " them"
    ]


@pytest.mark.parametrize("where", ["output", "manifest"])
def test_an_s3_endpoint_that_does_not_answer_is_one_line_without_retries(tiny_models, tmp_path, where):
    """A closed port on 127.0.0.1: one request, no retry (the job's 120 s outage tolerance is for a running job)."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    manifest, out_uri = (MANIFEST, "s3://my-bucket/job") if where == "output" else ("s3://my-bucket/m.csv", "out")
    env = _aws_env(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="key", AWS_SECRET_ACCESS_KEY="secret")
    for dry_run in (["--dry-run"], []):
        status, out = snapref(
            "render", manifest, "--models", str(tiny_models), "--out", out_uri, *dry_run, env=env, cwd=tmp_path
        )
        assert status == 2, out
        (line,) = error_lines(out)
        uri = out_uri if where == "output" else manifest
        assert line.startswith(
            f"error: the S3 endpoint {endpoint} did not answer a first request for {uri} within 5 s to connect and"
            " 10 s to answer (Could not connect to the endpoint URL: "
        ), line
        assert line.endswith("): check AWS_ENDPOINT_URL and that the store is up"), line
        assert "retrying" not in out and RAY_STARTED not in out, out


@pytest.mark.parametrize(
    "module, reads",
    [
        ("jobs.generate_dataset", {"manifest": MANIFEST}),
        ("jobs.identity_eval", {"manifest": str(EXAMPLES / "example_eval_manifest.csv")}),
        ("jobs.timing_table", {}),
    ],
    ids=["generate_dataset", "identity_eval", "timing_table"],
)
def test_the_ray_job_submit_doors_check_the_places_as_render_does(tiny_models, tmp_path, module, reads):
    """`python -m jobs.X SPEC` (what `ray job submit` and a RayJob run) with an s3:// output on an endpoint that
    does not answer: the same line as `render`'s, where each once retried for minutes (measured: still retrying
    after 5 minutes for the job, after 2 for the evaluation and the timing table)."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        json.dumps({**reads, "model": {"models_dir": str(tiny_models)}, "output": {"uri": "s3://my-bucket/job"}})
    )
    env = _aws_env(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="key", AWS_SECRET_ACCESS_KEY="secret")
    done = subprocess.run(
        [sys.executable, "-m", module, str(spec)], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    out = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in out, out[-4000:]
    (line,) = error_lines(out)
    assert line.startswith(
        f"error: the S3 endpoint {endpoint} did not answer a first request for s3://my-bucket/job within 5 s"
    ), line
    assert "retrying" not in out and RAY_STARTED not in out, out


# Ray 2.60's own exception when its raylet has not registered within 30 s (ray/_private/node.py), raised where Ray
# raises it (Node() inside ray.init), through a sitecustomize the command's Python loads: a real busy machine
# takes 30 s and more to say it.
_RAY_TIMES_OUT = textwrap.dedent(
    """
    import ray._private.node

    def _timed_out(self, *args, **kwargs):
        raise Exception(
            "The current node timed out during startup. This could happen because some of the raylet failed to "
            "startup or the GCS has become overloaded."
        )

    ray._private.node.Node.__init__ = _timed_out
    """
)


@pytest.fixture
def ray_times_out(tmp_path) -> dict[str, str]:
    """An environment whose Python's local Ray start times out as Ray's does."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_RAY_TIMES_OUT)
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    return env


def test_a_ray_start_that_times_out_is_one_line(ray_times_out, tiny_models, tmp_path):
    render = ["render", MANIFEST, "--models", str(tiny_models), "--out", str(tmp_path / "out"), "--width", "256"]
    serve = ["serve", "--models", str(tiny_models), "--port", str(free_port()), "--log", str(tmp_path / "serve.log")]
    for command in (render, serve):
        status, out = snapref(*command, env=ray_times_out, cwd=tmp_path)
        assert status == 2, out
        assert error_lines(out) == [
            "error: the local Ray did not start in time (The current node timed out during startup. This could"
            " happen because some of the raylet failed to startup or the GCS has become overloaded.); the machine"
            " is probably busy: run the command again (Ray's own logs: /tmp/ray/session_latest/logs)"
        ], out
        assert "serving on" not in out and "stopping:" not in out


@pytest.mark.parametrize(
    ("command", "hint"),
    [
        (["render", MANIFEST, "--models", "tiny", "--out", "out", "--stpes", "4"], "render: error: unrecognized"
         " arguments: --stpes 4 (did you mean --steps?)"),
        (["serve", "--models", "tiny", "--prot", "8000"], "serve: error: unrecognized arguments: --prot 8000"
         " (did you mean --port?)"),
        (["adapter", "inspect", "a.safetensors", "--jsno"], "adapter inspect: error: unrecognized arguments: --jsno"
         " (did you mean --json?)"),
        (["render", MANIFEST, "--xyz", "1"], "render: error: unrecognized arguments: --xyz 1"),
    ],
    ids=["render", "serve", "adapter-inspect", "nothing-close"],
)  # fmt: skip
def test_a_mistyped_flag_names_the_closest_flag_of_its_subcommand(command, hint):
    status, out = snapref(*command)
    assert status == 2, out
    assert out.splitlines()[0].startswith(f"usage: snapref-ray {command[0]}"), out
    assert out.rstrip().splitlines()[-1] == f"snapref-ray {hint}"


def test_compile_cache_without_compile_is_refused_in_one_line(tiny_models, tmp_path):
    cache = str(tmp_path / "graphs")
    common = ["render", MANIFEST, "--models", str(tiny_models), "--out", str(tmp_path / "out"), "--dry-run"]
    status, out = snapref(*common, "--compile-cache", cache)
    assert status == 2, out
    assert error_lines(out) == [
        f"error: --compile-cache {cache} is where compiled graphs are shared, and nothing compiles: add --compile"
        " (model.compile: true in a spec), or leave --compile-cache out"
    ]
    assert not Path(tmp_path / "out").exists()
    status, out = snapref(*common, "--compile-cache", cache, "--compile")
    assert status == 0 and "dry run: 8 manifest row(s)" in out, out


def test_the_readmes_first_screen_shows_the_job_the_endpoint_and_ray_data():
    """A reader who sees only the README's first 60 lines meets all three doors, each in one line."""
    first_screen = (EXAMPLES.parents[1] / "README.md").read_text().splitlines()[:60]
    for door in ("snapref-ray render ", "snapref-ray serve ", "map_batches(SnapRefRenderer"):
        assert [line for line in first_screen if door in line], f"{door!r} is not in the README's first 60 lines"
