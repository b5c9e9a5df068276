"""ArcAnima v2 and pilot on the tiny model against the float64 oracle of `arcanima_oracle.py`.

v2: the production path caches the reference K/V once and reads it through the attention seam
with a row-scaled LoRA; the oracle recomputes the reference inside one joint masked attention
at every call. Both are compared at every step of a short Euler run, for strength 0, 0.5 and 1,
with a reading (cond) and a non-reading (uncond) row in one batch.
pilot: the production path against a direct two-frame forward of the oracle.
The v2 LoRA's FLOPs are those of the reading rows only (FlopCounterMode against the shapes), the
reading and plain sub-batches put every row back in place, and v2 renders through the compiled
forward as eagerly (inductor's own lowering of the forward: tests/models/test_compiled.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.utils.flop_counter import FlopCounterMode

from snapref_ray.adapter.kinds import detect_kind
from snapref_ray.engine import Renderer
from snapref_ray.requests import RenderRequest, RenderSettings
from snapref_ray.sampling.ref_guidance import Row, StepRows
from snapref_ray.sampling.schedules import get_sigmas
from snapref_ray.tiny import TinyConfig, make_tiny, write_tiny_adapter
from tests.adapter.arcanima_oracle import Oracle

WIDTH = HEIGHT = 256  # latent 32x32 -> 16x16 target tokens
CONTEXT_ROWS = 7


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Many tiny float64 matmuls: with 2 threads on a shared 2-core machine they spend ~20x longer waiting.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_arc(tmp_path_factory) -> Path:
    folder = make_tiny(tmp_path_factory.mktemp("arc") / "m", with_adapter=False)
    for kind in ("arcanima-v2", "arcanima-pilot"):
        write_tiny_adapter(folder / f"{kind}.safetensors", TinyConfig(), kind)
    return folder


@pytest.fixture(scope="module")
def renderers(tiny_arc: Path) -> dict[str, Renderer]:
    base = Renderer.from_folder(tiny_arc, device="cpu")
    return {kind: base.with_adapter(tiny_arc / f"{kind}.safetensors") for kind in ("arcanima-v2", "arcanima-pilot")}


def contexts(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, CONTEXT_ROWS, TinyConfig().text_dim, generator=g) for _ in range(2)]


def velocity(renderer, x, sigma, ctx, refkv, reads, strength) -> torch.Tensor:
    plan = StepRows((Row.COND, Row.UNCOND), tuple(reads), False)
    reader = renderer.adapter.reader(renderer.resolve(RenderSettings(strength=strength)))
    d = renderer.denoise_rows(x, sigma, plan, {Row.COND: [ctx[0]], Row.UNCOND: [ctx[1]]}, refkv, reader)
    return torch.cat([(x - d[Row.COND]) / sigma, (x - d[Row.UNCOND]) / sigma])


@pytest.mark.parametrize("strength", [0.0, 0.5, 1.0])
def test_v2_cached_read_equals_uncached_joint_attention(tiny_arc, renderers, strength):
    renderer = renderers["arcanima-v2"]
    oracle = Oracle(tiny_arc / "dit.safetensors", tiny_arc / "arcanima-v2.safetensors")
    ref = (tiny_arc / "reference.png").read_bytes()
    prepared = renderer._prepare_reference([ref], "single", "", 1.0, None, (WIDTH, HEIGHT))
    refkv = renderer._run_reference_stream(prepared, renderer.target_grid(WIDTH, HEIGHT))
    ref_latent = prepared.latents[0]
    assert ref_latent.shape[-2:] != (HEIGHT // 8, WIDTH // 8)  # the reference has its own size
    ctx = contexts(1)
    x = torch.randn(1, 16, 1, HEIGHT // 8, WIDTH // 8, generator=torch.Generator().manual_seed(2))
    sigmas = get_sigmas("simple", 4)
    for i in range(len(sigmas) - 1):
        sigma = sigmas[i]
        v_prod = velocity(renderer, x, sigma, ctx, refkv, (True, False), strength)
        v_oracle = oracle.joint_v2_velocity(
            torch.cat([x, x]), float(sigma), [c[0] for c in ctx], [True, False], ref_latent, strength
        )
        scale = v_oracle.abs().max().item()
        torch.testing.assert_close(
            v_prod.double(),
            v_oracle,
            rtol=0,
            atol=2e-5 * max(scale, 1.0),
            msg=lambda m: f"step {i} (sigma {float(sigma):.4f}), strength {strength}: {m}",
        )
        # The read must matter, or the comparison would pass without it.
        no_ref = oracle.joint_v2_velocity(x, float(sigma), [ctx[0][0]], [False], ref_latent, strength)
        assert (v_oracle[:1] - no_ref).abs().max() > 1e-3 * scale
        x = x + (sigmas[i + 1] - sigma) * v_prod[:1]  # Euler on the cond row's velocity


def test_v2_strength_is_the_lora_multiplier_in_reading_rows_only(tiny_arc, renderers):
    renderer = renderers["arcanima-v2"]
    ref = renderer.encode_reference((tiny_arc / "reference.png").read_bytes(), width=WIDTH, height=HEIGHT)
    ctx = contexts(3)
    x = torch.randn(1, 16, 1, HEIGHT // 8, WIDTH // 8, generator=torch.Generator().manual_seed(4))
    sigma = torch.tensor(0.8)
    v = {s: velocity(renderer, x, sigma, ctx, ref, (True, False), s) for s in (0.0, 1.0)}
    assert not torch.allclose(v[0.0][:1], v[1.0][:1])  # the reading row changes with strength
    assert torch.equal(v[0.0][1:], v[1.0][1:])  # the non-reading row never sees the LoRA


def test_pilot_equals_direct_two_frame_forward(tiny_arc, renderers):
    renderer = renderers["arcanima-pilot"]
    oracle = Oracle(tiny_arc / "dit.safetensors", tiny_arc / "arcanima-pilot.safetensors")
    ref = (tiny_arc / "reference.png").read_bytes()
    frame = renderer.encode_reference(ref, width=WIDTH, height=HEIGHT)
    assert frame.payload == "frame_latent" and frame.kv_N2HLD.shape == (16, 1, HEIGHT // 8, WIDTH // 8)
    ctx = contexts(5)
    x = torch.randn(1, 16, 1, HEIGHT // 8, WIDTH // 8, generator=torch.Generator().manual_seed(6))
    sigma = torch.tensor(0.7)
    for strength in (0.5, 1.0):
        v_prod = velocity(renderer, x, sigma, ctx, frame, (True, False), strength)
        two_frames = torch.cat([x, frame.kv_N2HLD.unsqueeze(0)], dim=2)  # [1, 16, 2, h, w]
        v_read = oracle.frames_velocity(two_frames, 0.7, ctx[0][0], strength)[:, :, :1]
        v_plain = oracle.frames_velocity(x, 0.7, ctx[1][0], 0.0)
        expected = torch.cat([v_read, v_plain])
        torch.testing.assert_close(v_prod.double(), expected, rtol=0, atol=2e-5 * max(expected.abs().max().item(), 1))


def _lora_flops_of_one_row(renderer, tokens: int, context_rows: int) -> int:
    """Matmul FLOPs of the v2 LoRA in one row, from the model's shapes and the file's rank alone."""
    c = renderer.dit.config
    D, inner, M, C = c.model_channels, c.num_heads * c.head_dim, c.mlp_hidden, c.context_dim
    dims = {  # linear -> (tokens it sees, in, out)
        "self_attn.q_proj": (tokens, D, inner),
        "self_attn.k_proj": (tokens, D, inner),
        "self_attn.v_proj": (tokens, D, inner),
        "self_attn.output_proj": (tokens, inner, D),
        "cross_attn.q_proj": (tokens, D, inner),
        "cross_attn.k_proj": (context_rows, C, inner),
        "cross_attn.v_proj": (context_rows, C, inner),
        "cross_attn.output_proj": (tokens, inner, D),
        "mlp.layer1": (tokens, D, M),
        "mlp.layer2": (tokens, M, D),
    }
    rank = detect_kind(renderer.adapter.adapter.source).signature.ranks[0]
    hooked = sum(k is not None for k in renderer.adapter.hooked)
    return hooked * sum(2 * n * rank * (fan_in + fan_out) for n, fan_in, fan_out in dims.values())


@pytest.mark.parametrize(
    "rows, reads",
    [
        ((Row.COND, Row.UNCOND), (False, False)),
        ((Row.COND, Row.UNCOND), (True, False)),  # ref_in_uncond false, ref_guidance 1: one row reads
        ((Row.COND, Row.UNCOND), (True, True)),
        ((Row.COND, Row.UNCOND, Row.COND_NOREF), (True, True, False)),  # ref_guidance: the third row does not
    ],
)
def test_v2_lora_flops_scale_with_the_reading_rows(tiny_arc, renderers, rows, reads):
    renderer = renderers["arcanima-v2"]
    refkv = renderer.encode_reference((tiny_arc / "reference.png").read_bytes(), width=WIDTH, height=HEIGHT)
    ctx = contexts(7)
    ctx_for = {Row.COND: [ctx[0]], Row.UNCOND: [ctx[1]], Row.COND_NOREF: [ctx[0]]}
    x = torch.randn(1, 16, 1, HEIGHT // 8, WIDTH // 8, generator=torch.Generator().manual_seed(8))
    plan = StepRows(rows, reads, False)
    flops = {}
    for strength in (0.0, 1.0):  # strength 0: the same forward and reads, no LoRA
        reader = renderer.adapter.reader(renderer.resolve(RenderSettings(strength=strength)))
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            renderer.denoise_rows(x, torch.tensor(0.5), plan, ctx_for, refkv, reader)
        flops[strength] = counter.get_total_flops()
    one_row = _lora_flops_of_one_row(renderer, (HEIGHT // 16) * (WIDTH // 16), CONTEXT_ROWS)
    assert flops[1.0] - flops[0.0] == sum(reads) * one_row


@pytest.mark.slow
def test_v2_compiled_render_equals_eager_with_one_graph_per_row_layout(tiny_arc, renderers, monkeypatch):
    """`Renderer(compile=True)` with v2: both sub-batches of a step (reading rows with the LoRA and the
    read, plain rows) run as captured graphs, images as eager, graphs reused by later renders."""
    import snapref_ray.engine as engine_module
    from snapref_ray.models.compiled import compile_forward

    counter = CompileCounter()
    monkeypatch.setattr(engine_module, "compile_forward", functools.partial(compile_forward, backend=counter))
    compiled = Renderer.from_folder(tiny_arc, adapter=tiny_arc / "arcanima-v2.safetensors", device="cpu", compile=True)
    eager = renderers["arcanima-v2"]
    ref = (tiny_arc / "reference.png").read_bytes()
    one_reads = RenderSettings(
        width=WIDTH, height=HEIGHT, steps=2, sampler="euler", ref_in_uncond=False, ref_guidance=1.0
    )

    def image(renderer, settings) -> np.ndarray:
        request = RenderRequest(prompt="1girl, solo", seed=3, settings=settings)
        return np.asarray(renderer.render(request, references=[ref])[0].image, dtype=np.int16)

    got = image(compiled, one_reads)
    assert counter.frame_count == 2  # the cond row reading with the LoRA, the uncond row plain
    assert np.abs(got - image(eager, one_reads)).max() <= 1
    guided = one_reads.model_copy(update={"ref_guidance": 4.5})  # cond and uncond read, cond_noref does not
    assert np.abs(image(compiled, guided) - image(eager, guided)).max() <= 1
    assert counter.frame_count == 3  # two reading rows: one more graph; the one plain row's graph is reused
    assert np.abs(image(compiled, one_reads) - got).max() == 0 and counter.frame_count == 3  # reused


@pytest.mark.parametrize("reads", [(False, True), (True, True)])
def test_v2_reading_rows_anywhere_in_the_batch_equal_the_oracle(tiny_arc, renderers, reads):
    """The sub-batches put each row back in its place: a reading row after a plain one, and all rows reading."""
    renderer = renderers["arcanima-v2"]
    oracle = Oracle(tiny_arc / "dit.safetensors", tiny_arc / "arcanima-v2.safetensors")
    prepared = renderer._prepare_reference(
        [(tiny_arc / "reference.png").read_bytes()], "single", "", 1.0, None, (WIDTH, HEIGHT)
    )
    refkv = renderer._run_reference_stream(prepared, renderer.target_grid(WIDTH, HEIGHT))
    ctx = contexts(9)
    x = torch.randn(1, 16, 1, HEIGHT // 8, WIDTH // 8, generator=torch.Generator().manual_seed(10))
    v_prod = velocity(renderer, x, torch.tensor(0.55), ctx, refkv, reads, 0.8)
    v_oracle = oracle.joint_v2_velocity(
        torch.cat([x, x]), 0.55, [c[0] for c in ctx], list(reads), prepared.latents[0], 0.8
    )
    torch.testing.assert_close(v_prod.double(), v_oracle, rtol=0, atol=2e-5 * max(v_oracle.abs().max().item(), 1.0))


@pytest.mark.slow
def test_v2_reading_sub_batch_through_aot_autograd_equals_eager(renderers, tiny_arc):
    """v2's reading forward (the LoRA on all ten linears of every block, the text context's k/v projections
    too, and the read of every row) captured whole by dynamo and traced by AOTAutograd into the decomposed
    graph that inductor lowers, run, equals eager. Inductor's own lowering of that structure (a LoRA on
    every linear, reading and plain rows) is checked once, in
    tests/models/test_compiled.py::test_compiled_forward_equals_eager: an inductor compile costs most of a
    minute on a 2-core CPU, and v2 puts nothing into the forward that the LoRA pairs and reads there lack."""
    from snapref_ray.models.compiled import compile_forward

    renderer = renderers["arcanima-v2"]
    refkv = renderer.encode_reference((tiny_arc / "reference.png").read_bytes(), width=WIDTH, height=HEIGHT)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 16, 1, HEIGHT // 8, WIDTH // 8, generator=g)
    ctx = torch.randn(2, CONTEXT_ROWS, TinyConfig().text_dim, generator=g)
    sigma = torch.full((2,), 0.6)
    loras = renderer.adapter.full_loras(0.8)
    refs = refkv.reads((True, True), [1.0] * refkv.num_blocks)
    with torch.inference_mode():
        compiled = compile_forward(renderer.dit, backend="aot_eager")(x, sigma, ctx, loras=loras, refs=refs)
        eager = renderer.dit(x, sigma, ctx, loras=loras, refs=refs)
        without_lora = renderer.dit(x, sigma, ctx, refs=refs)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert (eager - without_lora).abs().max() > 1e-3  # the LoRA is in the graph


def test_v2_lora_rows_benchmark_smoke_forms_agree_and_flops_follow_the_reading_rows():
    """benchmarks/v2_lora_rows at smoke size checks its three forms give one velocity; the FLOPs of the
    engine's form (sub-batches) and of the gathered one are the former form's less the LoRA of the
    rows that do not read."""
    from benchmarks import v2_lora_rows

    table = v2_lora_rows.main(["--smoke"])
    for layout, reads in v2_lora_rows.LAYOUTS.items():
        row = table["layouts"][layout]
        assert (row["rows"], row["reading_rows"]) == (len(reads), sum(reads))
        before, gathered, split = (row[form]["gflop"] for form in v2_lora_rows.FORMS)
        assert gathered == pytest.approx(split, rel=1e-9)
        assert (gathered == pytest.approx(before, rel=1e-9)) if all(reads) else (gathered < before)
