"""Every `snapref-ray` command on a model folder of each adapter kind ends in a result or in one line.

`make-tiny --adapter-kind K` writes a folder whose adapter.safetensors is a SnapRef, ArcAnima v2 or
pilot file. Each command then either does its work (exit 0, its output checked) or, for a setting,
file or model that does not fit, prints one `error:` line naming the field or file and exits 2. No
traceback reaches the user unless `--debug` (or SNAPREF_DEBUG=1) asks for it.

Commands run in this process (`snapref_ray.cli.main`, what the console script calls); those that start
Ray use the session's local Ray (tests/conftest.py `local_ray_job`) and run here for the ArcAnima kinds
(tests/test_cli.py and tests/test_timing_job.py run them on SnapRef folders).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from snapref_ray import cli as snapref_cli
from snapref_ray.adapter.kinds import KINDS

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "snapref_ray" / "examples"
SMALL = ["--width", "256", "--height", "256", "--steps", "2", "--sampler", "euler"]
ADAPTER_KINDS = tuple(KINDS)
# The commands that start Ray run here for the ArcAnima kinds; tests/test_cli.py runs them on a SnapRef folder.
ARCANIMA_KINDS = tuple(kind for kind in KINDS if kind != "snapref")


@dataclass
class Outcome:
    status: int
    stdout: str
    stderr: str

    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]


def snapref_ray(*args: str) -> Outcome:
    """`snapref-ray ARGS` in this process; its exit status and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = snapref_cli.main(list(args))
        except SystemExit as e:  # argparse's own usage errors
            status = e.code
    outcome = Outcome(int(status or 0), out.getvalue(), err.getvalue())
    assert "Traceback" not in outcome.stderr, f"snapref-ray {' '.join(args)} printed a traceback:\n{outcome.stderr}"
    return outcome


def assert_result(outcome: Outcome) -> None:
    assert outcome.status == 0, outcome.stderr[-3000:]
    assert not outcome.error_lines()


def assert_one_line_error(outcome: Outcome, *names: str) -> str:
    """Exit 2 with exactly one `error:` line that names each of `names`; that line."""
    assert outcome.status == 2, (outcome.status, outcome.stderr[-3000:])
    lines = outcome.error_lines()
    assert len(lines) == 1, outcome.stderr
    assert all(name in lines[0] for name in names), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """One tiny model folder per adapter kind, as `snapref-ray make-tiny --adapter-kind K` writes it."""
    root = tmp_path_factory.mktemp("kinds")
    made = {}
    for kind in ADAPTER_KINDS:
        assert_result(snapref_ray("make-tiny", str(root / kind), "--adapter-kind", kind))
        made[kind] = root / kind
    return made


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("kinds-manifest") / "manifest.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["reference", "prompt", "seed"])
        writer.writeheader()
        writer.writerow({"reference": str(EXAMPLES / "example_refs" / "blue_hair_girl.png"), "prompt": "1girl, park"})
    return path


@pytest.mark.parametrize("kind", ADAPTER_KINDS)
def test_adapter_inspect_names_the_kind(folders, kind):
    outcome = snapref_ray("adapter", "inspect", str(folders[kind] / "adapter.safetensors"), "--json")
    assert_result(outcome)
    assert json.loads(outcome.stdout)["kind"] == kind


@pytest.mark.slow
@pytest.mark.parametrize("kind", ADAPTER_KINDS)
def test_txt2img_renders_at_the_kinds_defaults_and_refuses_a_setting_it_has_not(folders, kind, tmp_path):
    base = ["txt2img", "--models", str(folders[kind]), "--prompt", "1girl, smile", *SMALL]
    reference = ["--reference", str(folders[kind] / "reference.png")]
    assert_result(snapref_ray(*base, *reference, "--out", str(tmp_path / "a.png")))
    assert Image.open(tmp_path / "a.png").size == (256, 256)
    for name, _why in KINDS[kind].not_applicable.items():
        flag = {"ref_outside": ["--ref-outside", "no_reference"], "ref_caption": ["--ref-caption", "blue hair"]}.get(
            name
        )
        if flag is None:
            continue  # a setting with no txt2img flag of that form
        line = assert_one_line_error(
            snapref_ray(*base, *reference, *flag, "--out", str(tmp_path / "b.png")), name, kind
        )
        assert "does not apply" in line
        assert not (tmp_path / "b.png").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ARCANIMA_KINDS)
def test_render_a_manifest_with_each_kind(local_ray_job, folders, manifest, kind, tmp_path):
    out = tmp_path / "out"
    outcome = snapref_ray(
        "render", str(manifest), "--models", str(folders[kind]), "--out", str(out), "--no-progress", *SMALL
    )
    assert_result(outcome)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["images_total"], summary["failed_items"]) == (1, 0)
    (row,) = pq.read_table(out / "metadata").to_pylist()
    # the image was drawn at the kind's published defaults, as the metadata records them
    published = {name: KINDS[kind].settings_defaults[name] for name in ("ref_guidance", "ref_in_uncond")}
    assert {name: row[name] for name in published} == published


@pytest.mark.slow
@pytest.mark.parametrize("kind", ARCANIMA_KINDS)
def test_timing_picks_the_rows_of_the_kind_it_has(local_ray_job, folders, kind, tmp_path):
    outcome = snapref_ray(
        "timing",
        "--models",
        str(folders[kind]),
        *SMALL,
        "--repetitions",
        "1",
        "--no-warmup",
        "--out",
        str(tmp_path / "timing"),
    )
    assert_result(outcome)
    rows = json.loads((tmp_path / "timing" / "comparison_summary.json").read_text())["settings"]
    names = [r["name"] for r in rows]
    assert names[0] == "no_reference" and len(names) > 1
    assert not {"snapref_default", "recompute_every_step", "ref_in_uncond"} & set(names)
    assert names[1:] == [n for n in names[1:] if n.startswith(kind.replace("-", "_"))]
    # what it left out, and why, is said
    assert f"left out: snapref_default, a SnapRef row: the model's adapter is an {kind} file" in outcome.stdout


@pytest.mark.slow
@pytest.mark.parametrize("kind", ARCANIMA_KINDS)
def test_eval_reports_with_each_kind(local_ray_job, folders, kind, tmp_path):
    spec = yaml.safe_load((EXAMPLES / "example_eval_spec.yaml").read_text())
    spec.update(
        model={**spec["model"], "models_dir": str(folders[kind])},
        manifest=str(EXAMPLES / "example_eval_manifest.csv"),
        sigmas=[0.5],
        noise_seeds=[0],
        n_boot=100,
        target_megapixels=0.07,
        ref_megapixels=0.07,
        output={"uri": str(tmp_path / "eval")},
        cluster={**spec["cluster"], "cpu_workers": 1},
    )
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump(spec))
    assert_result(snapref_ray("eval", str(tmp_path / "eval.yaml")))
    report = json.loads((tmp_path / "eval" / "heldout_loss.json").read_text())
    assert report["n_failed"] == 0 and report["n_cases"] == 6
    assert report["adapter"]["kind"] == kind


# -- usage errors the same for every command -------------------------------------------------------


def test_a_models_folder_that_does_not_exist_is_one_line(tmp_path):
    missing = tmp_path / "no-such-models"
    for command in (["txt2img", "--prompt", "x", "--out", str(tmp_path / "x.png")], ["timing"]):
        assert_one_line_error(snapref_ray(*command, "--models", str(missing), *SMALL), str(missing))


def test_a_setting_out_of_range_names_its_field(folders, tmp_path):
    outcome = snapref_ray(
        "txt2img", "--models", str(folders["snapref"]), "--prompt", "x", "--out", str(tmp_path / "x.png"),
        "--width", "100", "--height", "256", "--steps", "2",
    )  # fmt: skip
    assert_one_line_error(outcome, "width")


def test_a_spec_with_the_old_model_keys_says_where_they_moved(folders, manifest, tmp_path):
    spec = tmp_path / "old.yaml"
    spec.write_text(
        yaml.safe_dump({"models": str(folders["snapref"]), "manifest": str(manifest), "output": {"uri": "out"}})
    )
    assert_one_line_error(snapref_ray("render", str(spec)), "models", "model:")


def test_debug_shows_the_traceback_of_a_usage_error(tmp_path):
    args = ["txt2img", "--models", str(tmp_path / "none"), "--prompt", "x", "--out", str(tmp_path / "x.png")]
    with pytest.raises(Exception, match="none"):
        snapref_cli.main(["--debug", *args])
