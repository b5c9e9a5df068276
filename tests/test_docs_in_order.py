"""The docs' own job commands, in the order a reader meets them, on one checkout: `snapref-ray render --help`'s
examples, the example spec as its own comment says to run it, `snapref-ray demo`, and the README's job block. Each
works after the ones before it: none of their outputs is "another job" for a later one (the fingerprint check
refused the example spec after the demo, and the README's line after the help's, when they shared an output
folder with other settings), and the demo keeps its models out of its dataset.

One subprocess runs them all through the command line's `main` (what the `snapref-ray` script calls), in a folder
that holds `snapref_ray/examples/` as a checkout does, as a driver of the session's local Ray: one Ray for the
whole sequence, where each command would start its own. The commands are read from the help text, the spec file
and the README, and run as written (256 px and 4 steps: the tiny models' smallest size, and the docs' steps).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from snapref_ray.cli import RENDER_EXAMPLES
from tests.doc_blocks import REPO, block, commands, fenced_blocks

EXAMPLES = REPO / "snapref_ray" / "examples"

# Each command through `main`, its exit status after it; on the driver's Ray (not a cluster: no RAY_ADDRESS, so the
# jobs start CPU workers, as on a laptop).
DRIVER = """
import json, shlex, sys
import ray
from snapref_ray.cli import main

ray.init(address=sys.argv[1], log_to_driver=False)
for line in json.loads(sys.argv[2]):
    argv = shlex.split(line)
    assert argv[0] == "snapref-ray", line
    status = main(argv[1:])
    print(f"EXIT {status}: {line}", flush=True)
    if status:
        break
"""


def help_commands() -> list[str]:
    """`render --help`'s examples that run on what the checkout holds (the others name a reader's own files)."""
    examples = commands(RENDER_EXAMPLES.split("\n\n", 1)[0])  # the lines above the exit statuses
    lines = [" ".join(line.split("#", 1)[0].split()) for line in examples if line.strip().startswith("snapref-ray ")]
    runnable = [line for line in lines if "make-tiny" in line or "snapref_ray/examples/" in line]
    assert [line.split()[2] for line in lines if line not in runnable] == ["manifest.csv", "more.csv", "job.yaml"]
    return runnable


def spec_commands() -> list[str]:
    """The commands the example spec's comment gives to run it."""
    text = (EXAMPLES / "example_spec.yaml").read_text()
    return [line.split("#", 2)[1].strip() for line in text.splitlines() if re.match(r"#\s+snapref-ray ", line)]


@pytest.mark.slow
def test_the_docs_commands_work_in_the_order_a_reader_meets_them(local_ray_job, tmp_path):
    checkout = tmp_path / "checkout"
    shutil.copytree(EXAMPLES, checkout / "snapref_ray" / "examples")
    demo = fenced_blocks("README.md", "Quick start")[0].split("&&")[-1].strip()
    readme = commands(block("README.md", "readme-job"))
    sequence = [*help_commands(), *spec_commands(), demo, *readme]
    assert sequence == [
        "snapref-ray make-tiny tiny",
        "snapref-ray render snapref_ray/examples/example_manifest.csv --models tiny --out out/run1 --width 256"
        " --height 256 --steps 4",
        "snapref-ray make-tiny tiny",
        "snapref-ray render snapref_ray/examples/example_spec.yaml",
        "snapref-ray demo",
        "snapref-ray make-tiny tiny",
        "snapref-ray render snapref_ray/examples/example_manifest.csv --models tiny --out out/run1 --width 256"
        " --height 256 --steps 4",
    ]
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, local_ray_job.address, json.dumps(sequence)],
        cwd=checkout,
        env=local_ray_job.driver_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-4000:]
    assert [line for line in printed.splitlines() if line.startswith("EXIT ")] == [f"EXIT 0: {c}" for c in sequence]
    assert "another job" not in printed and "Traceback" not in printed, printed[-4000:]
    out = checkout.resolve()
    # Three jobs, three folders; the README's line finds the help's job done (the same command).
    for folder, this_run in (("out/run1", 8), ("out/example", 8), ("demo-output", 8), ("out/run1", 0)):
        assert f"8 images in {out / folder} ({this_run} this run, {8 - this_run} already there, " in printed
    assert f"8 images in {out / 'out/run1'} (0 this run, 8 already there, 0 failed items, 0 invalid rows); nothing" in (
        printed
    )
    # The demo's models are the README's `tiny`, beside its dataset, not inside it.
    assert not list((checkout / "demo-output").rglob("*.safetensors"))
    assert (checkout / "tiny" / "dit.safetensors").is_file()
