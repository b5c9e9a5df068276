"""Every `snapref-ray` subcommand on one shared tiny model folder, its exit status and its output
(stdout, files, JSON, images) checked.

The commands run in this process (`snapref_ray.cli.main([...])`, what the console script calls); those
that start Ray use the session's local Ray (tests/conftest.py), as under `RAY_ADDRESS`. The commands the
README shows (demo, the quick-form render to a folder and to S3, `serve` answering curl) run as a user
runs them, as subprocesses, in tests/test_readme.py; `serve`'s flags are checked here.

Sizes are the smallest the settings allow (256 px) and 2 steps; the commands that start Ray or
render (txt2img, render, eval, timing) are marked slow.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from snapref_ray import cli as snapref_cli
from snapref_ray.job_spec import JobSpecError

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "snapref_ray" / "examples"
SMALL = ["--width", "256", "--height", "256", "--steps", "2"]


def run(*args: str) -> str:
    """`snapref-ray ARGS` in this process: its stdout; fails with its stderr unless it exits 0."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = snapref_cli.main(list(args))
        except SystemExit as e:  # argparse and the commands' own usage errors
            status = e.code
    assert status == 0, f"snapref-ray {' '.join(args)} exited {status}:\n{err.getvalue()[-4000:]}"
    return out.getvalue()


def pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """`snapref-ray make-tiny DIR`: the one tiny model folder every command below uses."""
    folder = tmp_path_factory.mktemp("cli") / "tiny"
    out = run("make-tiny", str(folder))
    assert f"wrote a tiny model set to {folder}" in out
    for name in (
        "dit.safetensors",
        "text_encoder.safetensors",
        "vae.safetensors",
        "adapter.safetensors",
        "reference.png",
        "tokenizers/qwen/vocab.json",
        "tokenizers/t5/tokenizer.json",
    ):
        assert (folder / name).is_file(), name
    return folder


@pytest.fixture(scope="module")
def manifest(models: Path) -> Path:
    path = models.parent / "manifest.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["reference", "prompt", "seed"])
        w.writerow([str(models / "reference.png"), "1girl, solo, smile", 1])
        w.writerow([str(EXAMPLES / "example_refs" / "brown_hair_boy.png"), "1boy, park", 2])
    return path


def test_adapter_inspect(models):
    out = run("adapter", "inspect", str(models / "adapter.safetensors"))
    assert "anima_ref_kv/1" in out and "anima-tiny" in out
    assert "cs" in out and "char" in out


@pytest.mark.slow
def test_txt2img_without_and_with_references_and_a_lora(models, tmp_path):
    plain, ref, pair, lora = (tmp_path / f"{n}.png" for n in ("plain", "ref", "pair", "lora"))
    out = run(
        "txt2img",
        "--models",
        str(models),
        "--prompt",
        "1girl, smile",
        "--out",
        str(plain),
        "--seed",
        "3",
        "--sampler",
        "euler",
        *SMALL,
    )
    assert str(plain) in out and "seed 3" in out
    out = run(
        "txt2img",
        "--models",
        str(models),
        "--prompt",
        "1girl, beach",
        "--out",
        str(ref),
        "--seed",
        "3",
        "--sampler",
        "euler",
        "--reference",
        str(models / "reference.png"),
        "--mode",
        "cs",
        "--ref-weight",
        "1.0",
        *SMALL,
    )
    assert "reference encode" in out
    run(
        "txt2img",
        "--models",
        str(models),
        "--prompt",
        "2girls, left and right",
        "--out",
        str(pair),
        "--seed",
        "3",
        "--sampler",
        "euler",
        "--reference",
        str(models / "reference.png"),
        "--reference2",
        str(EXAMPLES / "example_refs" / "blue_hair_girl.png"),
        *SMALL,
    )
    # make-tiny's style LoRA (ComfyUI key layout, two linears of the tiny DiT)
    run(
        "txt2img",
        "--models",
        str(models),
        "--prompt",
        "1girl, smile",
        "--out",
        str(lora),
        "--seed",
        "3",
        "--sampler",
        "euler",
        "--lora",
        f"{models / 'style-lora.safetensors'}:0.8",
        *SMALL,
    )
    images = {p.stem: pixels(p) for p in (plain, ref, pair, lora)}
    assert all(img.shape == (256, 256, 3) for img in images.values())
    for name in ("ref", "pair", "lora"):
        assert np.abs(images[name] - images["plain"]).max() > 0, f"{name} drew the same image as the plain render"
    assert np.abs(images["pair"] - images["ref"]).max() > 0


@pytest.fixture(scope="module")
def local_job(local_ray_job, models, manifest) -> Path:
    """`snapref-ray render SPEC.yaml`: a job spec naming the tiny models, a local output."""
    out = models.parent / "job-out"
    spec = yaml.safe_load((EXAMPLES / "example_spec.yaml").read_text())
    spec.update(
        model={**spec["model"], "models_dir": str(models)},
        manifest=str(manifest),
        output={"uri": str(out)},
        defaults={**spec["defaults"], "steps": 2},
        cluster={**spec["cluster"], "cpu_workers": 1},
    )
    spec_path = models.parent / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    stdout = run("render", str(spec_path), "--no-progress")
    assert f"2 images in {out}" in stdout and "0 failed" in stdout
    return out


@pytest.mark.slow
def test_render_spec_writes_images_metadata_and_summary(local_job):
    import pyarrow.parquet as pq

    summary = json.loads((local_job / "summary.json").read_text())
    assert (summary["images_total"], summary["failed_items"]) == (2, 0)
    table = pq.read_table(local_job / "metadata")
    assert table.num_rows == 2 and sorted(table.column("prompt").to_pylist()) == ["1boy, park", "1girl, solo, smile"]
    assert len(list((local_job / "images").iterdir())) == 2
    # The batch each image was rendered in is recorded, and summed up in the summary.
    batches = table.column("forward_batch").to_pylist()
    assert all(b >= 1 for b in batches)
    assert summary["forward_batches"] == {str(b): batches.count(b) for b in set(batches)}


@pytest.mark.slow
def test_report_regenerates_the_gallery(local_job):
    (local_job / "gallery.html").unlink()
    result = json.loads(run("report", str(local_job)))
    assert (local_job / "gallery.html").is_file()
    assert "1girl, solo, smile" in (local_job / "gallery.html").read_text()
    assert result  # what was written, as JSON


@pytest.mark.slow
def test_eval(local_ray_job, models, tmp_path):
    spec = yaml.safe_load((EXAMPLES / "example_eval_spec.yaml").read_text())
    spec.update(
        model={**spec["model"], "models_dir": str(models)},
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
    out = run("eval", str(tmp_path / "eval.yaml"))
    report = json.loads((tmp_path / "eval" / "heldout_loss.json").read_text())
    assert report["n_failed"] == 0 and report["n_cases"] == 6
    assert f"{report['n_cases']} cases of {report['n_characters']} characters" in out
    assert np.isfinite(report["gap"]) and report["mean_loss_right"] > 0


@pytest.mark.slow
def test_timing(local_ray_job, models, tmp_path):
    out = run(
        "timing",
        "--models",
        str(models),
        *SMALL,
        "--sampler",
        "euler",
        "--repetitions",
        "1",
        "--settings",
        "snapref_default",
        "--no-warmup",
        "--out",
        str(tmp_path / "timing"),
    )
    summary = json.loads((tmp_path / "timing" / "comparison_summary.json").read_text())
    rows = summary["settings"]
    assert [row["name"] for row in rows] == ["no_reference", "snapref_default"]
    assert all(row["seconds_per_image"] > 0 for row in rows)
    assert all(row["label"] in out for row in rows)  # the Markdown table printed


def test_serve_flags_build_the_served_model_spec(models, tmp_path, monkeypatch):
    """`serve --models DIR --lora FILE:0.7 --dtype ...` builds the server's ModelSpec with the job's field names
    (model_spec.py), paths resolved against the working directory. The server itself, run as the README shows
    it, is tests/test_readme.py's; a served LoRA's pixels, tests/test_cross_path.py's."""
    from snapref_ray.serve.cli import config_from_args

    monkeypatch.chdir(models.parent)
    parser = snapref_cli.build_parser()
    args = parser.parse_args(
        ["serve", "--models", "tiny", "--lora", "tiny/style-lora.safetensors:0.7", "--dtype", "float32"]
    )
    config = config_from_args(args)
    assert config.model.models_dir == str(models)
    assert [(lora.path, lora.strength) for lora in config.model.loras] == [
        (str(models / "style-lora.safetensors"), 0.7)
    ]
    assert config.model.dtype == "float32"


def test_a_serve_config_file_s_mistakes_are_one_line_naming_the_file(models, tmp_path):
    """`serve --config FILE` reads YAML or JSON like a job spec: a missing file, a file that is no mapping and a bad
    field each name the file (they were "[Errno 2] No such file...", "Expecting value: line 1 column 1" and
    "max_bach: unknown field")."""
    from snapref_ray.serve.cli import config_from_args

    parser = snapref_cli.build_parser()
    typo = tmp_path / "serve.json"
    typo.write_text(json.dumps({"model": {"models_dir": str(models)}, "max_bach": 3}))
    text = tmp_path / "notes.txt"
    text.write_text("just words")
    for path, says in (
        (tmp_path / "missing.yaml", f"serve config {tmp_path / 'missing.yaml'} not found"),
        (text, f"{text}: expected a mapping of spec fields at the top, found str"),
        (typo, f"invalid serve config {typo}:\n  max_bach: unknown field (did you mean 'max_batch'?)"),
    ):
        with pytest.raises(JobSpecError) as error:
            config_from_args(parser.parse_args(["serve", "--config", str(path)]))
        assert str(error.value) == says


def test_txt2img_refuses_a_bad_flag_before_it_loads_the_model(tmp_path, capsys):
    """A bad setting, seed or count is one `error:` line and exit status 2 before the model is loaded (a minute with
    real weights): here the model folder does not even exist, and the error names the flag's field, not the folder.
    `--n 0` once rendered nothing and exited 0 without a word; `--out a.gif` got PNG bytes."""
    missing = str(tmp_path / "no-models")
    command = ["txt2img", "--models", missing, "--prompt", "a", "--out", str(tmp_path / "a.png")]
    for extra, says in (
        (["--width", "100"], "error: width: width must be a multiple of 16"),
        (["--seed", "-1"], "error: seed: Input should be greater than or equal to 0"),
        (["--steps", "0"], "error: steps: Input should be greater than or equal to 1"),
        (["--out", str(tmp_path / "a.gif")], "the image formats are .png, .webp, .jpg, .jpeg"),
    ):
        assert snapref_cli.main([*command, *extra]) == 2
        err = capsys.readouterr().err
        assert says in err and missing not in err, err
    with pytest.raises(SystemExit) as exit_:
        snapref_cli.main([*command, "--n", "0"])
    assert exit_.value.code == 2 and "argument --n: must be 1 or more, got 0" in capsys.readouterr().err
    assert not (tmp_path / "a.png").exists()


def test_serve_config_files_host_and_port_hold_unless_a_flag_is_given(models, tmp_path):
    """`serve --config FILE`: the file's host and port were once replaced by the flags' defaults (127.0.0.1:8000)
    whether or not a flag was given; now a flag left out keeps the file's value, a flag given wins."""
    from snapref_ray.serve.cli import config_from_args, log_path

    config_file = tmp_path / "serve.yaml"
    config_file.write_text(f"model: {{models_dir: {models}}}\nhost: 127.0.0.2\nport: 9123\n")
    parser = snapref_cli.build_parser()
    args = parser.parse_args(["serve", "--config", str(config_file)])
    config = config_from_args(args)
    assert (config.host, config.port) == ("127.0.0.2", 9123)
    assert log_path(args, config.port).endswith("snapref-ray-serve-9123.log")
    config = config_from_args(parser.parse_args(["serve", "--config", str(config_file), "--port", "9200"]))
    assert (config.host, config.port) == ("127.0.0.2", 9200)
    config = config_from_args(parser.parse_args(["serve", "--models", str(models)]))
    assert (config.host, config.port) == ("127.0.0.1", 8000)  # the ServeConfig defaults


def test_render_judge_flags_build_the_jobs_judge_section(tmp_path):
    """`render MANIFEST --judge sanity,near_duplicate --max-renders-per-item 2 --kept-per-reference 5`: the quick
    form's judge: section (docs/judging.md); the loop's flags alone are refused, naming --judge."""
    manifest = tmp_path / "m.csv"
    manifest.write_text("reference,prompt\nref.png,a\n")
    parser = snapref_cli.build_parser()
    quick = ["render", str(manifest), "--models", str(tmp_path), "--out", str(tmp_path / "out")]
    args = parser.parse_args(
        [*quick, "--judge", "sanity,near_duplicate", "--max-renders-per-item", "2", "--kept-per-reference", "5"]
    )
    judge = snapref_cli.render_spec(args).judge
    assert judge.checks == ("sanity", "near_duplicate")
    assert (judge.max_renders_per_item, judge.kept_per_reference, judge.keep_rejected_images) == (2, 5, True)
    assert snapref_cli.render_spec(parser.parse_args(quick)).judge is None
    with pytest.raises(ValueError, match="need --judge"):
        snapref_cli.render_spec(parser.parse_args([*quick, "--kept-per-reference", "5"]))


def test_render_flags_are_validated_as_the_spec_fields_they_set(tmp_path, monkeypatch):
    """A flag over a spec file sets its field and goes through the spec's validation like it: `--wait-for-lease -5`
    was once copied into the spec unchecked (the run then waited no time at all); now it is refused naming the
    field, in both forms. `--judge` names the checks that run, and a check the spec sets up keeps its settings."""
    manifest = tmp_path / "m.csv"
    manifest.write_text("reference,prompt\nref.png,a\n")
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(
        f"manifest: {manifest}\nmodel: {{models_dir: {tmp_path}}}\noutput: {{uri: {tmp_path / 'out'}}}\n"
        "judge: {near_duplicate: {max_distance: 3}, sanity: {}, max_renders_per_item: 4}\n"
    )
    parser = snapref_cli.build_parser()
    quick = ["render", str(manifest), "--models", str(tmp_path), "--out", str(tmp_path / "out")]
    for form in (quick, ["render", str(spec_file)]):
        with pytest.raises(JobSpecError, match=r"output\.lease_wait_seconds: Input should be greater than or equal"):
            snapref_cli.render_spec(parser.parse_args([*form, "--wait-for-lease", "-5"]))
        with pytest.raises(JobSpecError, match=r"judge\.max_renders_per_item: Input should be greater than or equal"):
            snapref_cli.render_spec(parser.parse_args([*form, "--judge", "sanity", "--max-renders-per-item", "0"]))
    judge = snapref_cli.render_spec(parser.parse_args(["render", str(spec_file), "--judge", "near_duplicate"])).judge
    assert judge.checks == ("near_duplicate",) and judge.near_duplicate.max_distance == 3
    assert judge.max_renders_per_item == 4  # the spec's loop setting stays where no flag sets it
    spec = snapref_cli.render_spec(parser.parse_args(["render", str(spec_file), "--kept-per-reference", "2"]))
    assert spec.judge.checks == ("sanity", "near_duplicate") and spec.judge.kept_per_reference == 2
    # Every flag sets its field over a spec file too (they were once ignored there without a word).
    spec = snapref_cli.render_spec(parser.parse_args(["render", str(spec_file), "--steps", "3", "--workers", "1"]))
    assert (spec.defaults.steps, spec.cluster.num_workers, spec.cluster.max_workers) == (3, 1, None)
    with pytest.raises(JobSpecError, match=r"cluster\.num_workers: Input should be greater than or equal to 1"):
        snapref_cli.render_spec(parser.parse_args(["render", str(spec_file), "--workers", "0"]))
    # The flags' relative paths are the current directory's, made absolute (one fingerprint however spelled).
    monkeypatch.chdir(tmp_path)
    spec = snapref_cli.render_spec(parser.parse_args(["render", str(spec_file), "--out", "elsewhere", "--models", "."]))
    assert (spec.output.uri, spec.model.models_dir) == (str(tmp_path / "elsewhere"), str(tmp_path))


def test_eval_flags_are_validated_as_the_spec_fields_they_set():
    """`snapref-ray eval SPEC --workers N --out DIR` over the example evaluation spec: the count replaces the spec's
    range, and a bad count is refused naming the field (both were once copied into the spec unchecked)."""
    from snapref_ray.eval_cli import eval_spec

    parser = snapref_cli.build_parser()
    example = str(Path(snapref_cli.__file__).parent / "examples" / "example_eval_spec.yaml")
    spec = eval_spec(parser.parse_args(["eval", example, "--workers", "3", "--out", "elsewhere"]))
    assert (spec.cluster.num_workers, spec.cluster.max_workers, spec.output.uri) == (3, None, "elsewhere")
    with pytest.raises(JobSpecError, match=r"cluster\.num_workers: Input should be greater than or equal to 1"):
        eval_spec(parser.parse_args(["eval", example, "--workers", "-2"]))


# -- the help: every flag explained, defaults shown, examples -----------------------------------------


def _subparsers(parser) -> dict[str, object]:
    """Every (sub)command's parser by its path ("render", "adapter inspect", ...)."""
    import argparse

    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = sub
                found.update({f"{name} {k}": v for k, v in _subparsers(sub).items()})
    return found


def test_every_flag_has_help_and_shows_its_default():
    import argparse

    parsers = {"": snapref_cli.build_parser(), **_subparsers(snapref_cli.build_parser())}
    assert {"render", "serve", "make-tiny", "adapter inspect", "timing"} <= set(parsers)
    for name, parser in parsers.items():
        text = parser.format_help()
        assert "MODEL_" not in text, f"snapref-ray {name} --help shows an internal metavar:\n{text}"
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            flag = "/".join(action.option_strings) or action.dest
            assert action.help, f"snapref-ray {name}: {flag} has no help text"
            default = action.default
            none = default is None or default is False or default is argparse.SUPPRESS or default == []
            if none or not action.option_strings:
                continue
            shown = parser._get_formatter()._get_help_string(action)  # the text --help prints
            assert "default" in shown, f"snapref-ray {name}: {flag} does not show its default {default!r}"


def test_render_help_has_examples_and_the_usage_asks_for_no_adapter():
    parsers = _subparsers(snapref_cli.build_parser())
    render = parsers["render"].format_help()
    assert "examples:\n  snapref-ray make-tiny tiny\n  snapref-ray render " in render
    assert "--dry-run" in render and "--append" in render and "exit status: 0" in render
    top = snapref_cli.build_parser().format_help()
    assert "--adapter" not in top  # an adapter file is optional: the models folder's adapter.safetensors is used
    assert "--version" in top
