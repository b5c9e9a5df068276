"""`Renderer(compile=True)` end to end: every step runs the captured graph, the images equal eager
ones, and new prompts, seeds and references of one size reuse the graphs they compiled.

The graphs are captured by dynamo with `fullgraph=True` exactly as in production; the backend is
a `CompileCounter` (it runs the captured graph as is and counts compilations), because an inductor
compile costs minutes on a 2-core CPU. Inductor's own numerics on the same forward are checked in
tests/models/test_compiled.py::test_compiled_forward_equals_eager, and on a GPU by gpu_suite.
"""

from __future__ import annotations

import functools
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torch._dynamo.testing import CompileCounter

import snapref_ray.engine as engine_module
from snapref_ray.engine import Renderer
from snapref_ray.models.compiled import compile_forward
from snapref_ray.requests import RenderRequest, RenderSettings

SETTINGS = RenderSettings(width=256, height=256, steps=3, sampler="euler", cfg=4.0)


@pytest.fixture(scope="module")
def counted(tiny_models: Path):
    """(compiled Renderer, its CompileCounter, an eager Renderer) on the tiny model set."""
    counter = CompileCounter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "compile_forward", functools.partial(compile_forward, backend=counter))
        compiled = Renderer.from_folder(tiny_models, device="cpu", compile=True)
    return compiled, counter, Renderer.from_folder(tiny_models, device="cpu")


def _render(renderer: Renderer, prompt: str, seed: int, reference: bytes | None = None) -> np.ndarray:
    (result,) = renderer.render(
        [RenderRequest(prompt=prompt, seed=seed, settings=SETTINGS)], references=[reference] if reference else None
    )
    return np.asarray(result.image, dtype=np.int16)


@pytest.mark.slow
def test_compiled_renderer_equals_eager_and_compiles_once_per_layout(counted, tiny_models: Path):
    compiled, counter, eager = counted
    assert compiled.compiled and compiled.forward is not compiled.dit
    reference = (tiny_models / "reference.png").read_bytes()

    with_ref = _render(compiled, "1girl, solo, smile", 7, reference)
    assert counter.frame_count == 1  # CFG rows, the cond row reading: one graph for the whole render
    assert np.abs(with_ref - _render(eager, "1girl, solo, smile", 7, reference)).max() <= 1

    _render(compiled, "1boy, night, rain", 8, reference)  # a new prompt and seed
    assert counter.frame_count == 1, "a new prompt or seed recompiled the forward"
    size = Image.open(io.BytesIO(reference)).size
    other = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(other, "PNG")
    _render(compiled, "1girl, park", 9, other.getvalue())  # another reference of the same size
    assert counter.frame_count == 1, "a new reference of the same size recompiled the forward"

    plain = _render(compiled, "1girl, solo, smile", 7)  # no reference: another row layout, one more graph
    assert counter.frame_count == 2
    assert np.abs(plain - _render(eager, "1girl, solo, smile", 7)).max() <= 1
    assert np.abs(plain - with_ref).max() > 0  # the reference did something in the compiled graph


def test_cli_compile_flag_reaches_the_job_spec(monkeypatch, tmp_path: Path, capsys):
    """`snapref-ray render ... --compile` sets model.compile, which the workers' config carries.

    The job itself is replaced (a compiled render costs minutes on a CPU): it records the spec the
    command built and answers an empty job's summary, which the command prints."""
    from snapref_ray import cli
    from snapref_ray.pipelines import generate_dataset
    from snapref_ray.pipelines.job_summary import JobSummary

    seen = []

    def run_job(spec, progress=True):
        seen.append((spec, progress))
        return JobSummary.model_construct(
            images_total=0,
            output=spec.output.uri,
            images_this_run=0,
            skipped_already_done=0,
            failed_items=0,
            invalid_rows=0,
            images_per_hour=0.0,
            encodes_per_reference=0.0,
        )

    monkeypatch.setattr(generate_dataset, "run_job", run_job)
    manifest = tmp_path / "m.csv"
    manifest.write_text("reference,prompt\nref.png,1girl\n")
    out = tmp_path / "out"
    argv = ["render", str(manifest), "--models", str(tmp_path), "--out", str(out), "--compile", "--no-progress"]
    assert cli.main(argv) == 0
    ((spec, progress),) = seen
    assert progress is False
    assert spec.model.compile is True
    assert generate_dataset.worker_config(spec).model.compile is True
    assert f"0 images in {out} (0 this run" in capsys.readouterr().out
