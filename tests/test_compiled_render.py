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
from snapref_ray.jobs.job_settings import JobSettings
from snapref_ray.models.compiled import compile_forward
from snapref_ray.render_service.cold_start import WARMUP_STEPS
from snapref_ray.render_service.references import Reference
from snapref_ray.render_service.service import RenderService
from snapref_ray.requests import RenderRequest, RenderSettings
from snapref_ray.tiny import write_tiny_adapter

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


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["arcanima-v2", "arcanima-pilot"])
def test_arcanima_renders_through_the_compiled_block_equal_eager(counted, tiny_models: Path, tmp_path: Path, kind):
    """ArcAnima v2 (a LoRA on every linear of the reading rows) and the pilot (two-frame latents) render
    through the regionally compiled block as they render eagerly."""
    compiled, counter, eager = counted
    adapter = write_tiny_adapter(tmp_path / f"{kind}.safetensors", adapter_kind=kind)
    compiled_kind, eager_kind = compiled.with_adapter(adapter), eager.with_adapter(adapter)
    reference = (tiny_models / "reference.png").read_bytes()
    before = counter.frame_count
    settings = RenderSettings(width=256, height=256, steps=2, sampler="euler", cfg=4.0)
    images = [
        r.render([RenderRequest(prompt="1girl, solo", seed=3, settings=settings)], references=[reference])[0].image
        for r in (compiled_kind, eager_kind)
    ]
    assert counter.frame_count > before  # the kind's rows ran through the compiled block
    a, b = (np.asarray(image, dtype=np.int16) for image in images)
    assert np.abs(a - b).max() <= 1


@pytest.mark.slow
def test_warm_up_builds_the_jobs_graphs_and_reports_the_cold_start(counted, tiny_models: Path):
    """`RenderService.warmup(sizes, batch_sizes)` builds every graph the work needs (with a reference read,
    since the tiny set has an adapter): a batch of 2 with a reference after it compiles nothing; the cold
    start names what was warmed and how long each phase took."""
    compiled, counter, _ = counted
    service = RenderService(compiled)
    before = counter.frame_count
    cold = service.warmup([(256, 256)], [1, 2])
    assert counter.frame_count > before
    assert cold.warmed == ("256x256 x1+ref", "256x256 x2+ref")
    assert cold.compiled and cold.warmup_s > 0 and cold.first_image_s is not None
    assert cold.first_image_s >= cold.model_load_s == pytest.approx(compiled.load_seconds, abs=1e-3)
    assert cold.graphs_built == 0  # CompileCounter: graphs captured, none built by inductor
    warmed = counter.frame_count
    reference = (tiny_models / "reference.png").read_bytes()
    settings = RenderSettings(width=256, height=256, steps=WARMUP_STEPS + 1)
    read = Reference.of_images([reference], "single", settings, ["reference.png"])
    service.render([RenderRequest(prompt=p, settings=settings) for p in ("a", "b")], reference=read)
    assert counter.frame_count == warmed, "a warmed batch size compiled a new graph"
    assert service.describe()["cold_start"]["warmed"] == ["256x256 x1+ref", "256x256 x2+ref"]


def test_cli_compile_flag_reaches_the_job_spec(monkeypatch, tmp_path: Path, capsys):
    """`snapref-ray render ... --compile` sets model.compile, which the workers' config carries.

    The job itself is replaced (a compiled render costs minutes on a CPU): it records the spec the
    command built and answers an empty job's summary, which the command prints."""
    from snapref_ray import cli
    from snapref_ray.jobs import generate_dataset
    from snapref_ray.jobs.job_summary import JobSummary

    seen = []

    def run_job(spec, progress=True):
        seen.append((spec, progress))
        return JobSummary.model_construct(
            memory_per_worker=None,
            memory_fit=[],
            images_total=0,
            output=spec.output.uri,
            images_this_run=0,
            skipped_already_done=0,
            failed_items=0,
            invalid_rows=0,
            images_per_hour=0.0,
            encodes_per_reference=0.0,
            items=0,
            job_images=0,
            not_rendered=[],
            runs=[],
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
    assert generate_dataset.worker_config(JobSettings.of(spec)).model.compile is True
    assert f"0 images in {out} (0 this run" in capsys.readouterr().out
