"""The DiT forward has no device read-backs and compiles to graphs that prompts and references reuse.

`torch.compile(fullgraph=True)` refuses a graph break, and a device-to-host read in the forward
(`.item()`, `bool(tensor)`, boolean indexing: data-dependent control flow or shapes) is one, so
tracing a whole forward with fullgraph is the CPU stand-in for `torch.cuda.set_sync_debug_mode`
(which the same tests also switch to "error" when CUDA is there).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from snapref_ray.models.attention import RefRead
from snapref_ray.models.compiled import compile_forward
from snapref_ray.models.dit import BLOCK_LINEARS, load_dit
from snapref_ray.models.ops import LoRAPair
from snapref_ray.models.tiny_dit import make_tiny_dit_state_dict

BLOCKS, WIDTH, HEAD_DIM, CONTEXT = 2, 64, 32, 64


@pytest.fixture(scope="module")
def dit():
    return load_dit(
        make_tiny_dit_state_dict(
            model_channels=WIDTH, num_blocks=BLOCKS, head_dim=HEAD_DIM, context_dim=CONTEXT, seed=3
        )
    )


def _inputs(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, 16, 1, 8, 6, generator=g),
        torch.full((rows,), 0.7),
        torch.randn(rows, 12, CONTEXT, generator=g),
    )


def _refs(dit, reading: tuple[bool, ...], seed: int, weights=(1.0, 0.25)):
    g = torch.Generator().manual_seed(seed)
    kv = dit.reference_kv(
        torch.randn(1, 16, 1, 6, 6, generator=g), torch.randn(1, 12, CONTEXT, generator=g), rope_offset=(0, 0, 3)
    )
    return [RefRead(k, v, reading, w) for (k, v), w in zip(kv, weights)]


def _target_loras(seed: int):
    g = torch.Generator().manual_seed(seed)
    pair = LoRAPair(0.1 * torch.randn(4, WIDTH, generator=g), 0.1 * torch.randn(WIDTH, 4, generator=g), 1.0)
    return [{"self_attn.q_proj": pair}] * BLOCKS


def _every_linear_lora(dit, seed: int, rank: int = 4):
    """A rank-`rank` LoRA on each of the ten linears of every block (the text context's k/v projections
    too), as ArcAnima v2's adapter and a style LoRA over all targets put them."""
    g = torch.Generator().manual_seed(seed)
    loras = []
    for block in dit.blocks:
        pairs = {}
        for name in BLOCK_LINEARS:
            out_features, in_features = block.get_submodule(name).weight.shape
            down = 0.1 * torch.randn(rank, in_features, generator=g)
            pairs[name] = LoRAPair(down, 0.1 * torch.randn(out_features, rank, generator=g), 0.8)
        loras.append(pairs)
    return loras


def _no_syncs():
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("error")
        return contextlib.ExitStack().callback(torch.cuda.set_sync_debug_mode, "default")
    return contextlib.nullcontext()


CASES = {  # rows, which rows read
    "plain": (2, None),
    "snapref_reading_all": (2, (True, True)),
    "mixed_rows": (3, (True, True, False)),  # ref_guidance: cond + uncond read, cond_noref does not
    "mixed_not_a_prefix": (3, (False, True, False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_traces_as_one_graph_with_no_host_reads(dit, case):
    rows, reading = CASES[case]
    counter = CompileCounter()
    forward = compile_forward(dit, backend=counter)
    x, sigma, ctx = _inputs(rows, 0)
    refs = _refs(dit, reading, 1) if reading else None
    with torch.inference_mode(), _no_syncs():
        out = forward(x, sigma, ctx, loras=_target_loras(2), refs=refs)
        eager = dit(x, sigma, ctx, loras=_target_loras(2), refs=refs)
    assert counter.frame_count == 1  # fullgraph: one frame, or dynamo raised
    torch.testing.assert_close(out, eager, rtol=0, atol=0)  # the eager backend runs the same ops


def test_prompts_references_and_weights_do_not_recompile(dit):
    counter = CompileCounter()
    forward = compile_forward(dit, backend=counter)
    with torch.inference_mode():
        for seed in range(3):  # new prompts (contexts), latents and sigma
            x, sigma, ctx = _inputs(2, seed)
            forward(x, sigma * (seed + 1) / 4, ctx)
        assert counter.frame_count == 1
        for seed in range(3):  # new references of the same size, new read weights
            x, sigma, ctx = _inputs(2, 10 + seed)
            forward(x, sigma, ctx, refs=_refs(dit, (True, False), 20 + seed, weights=(1.0, 0.5 + seed)))
        assert counter.frame_count == 2  # one more graph: the reading row layout, then reused
        forward(*_inputs(3, 0), refs=_refs(dit, (True, True, False), 30))
        assert counter.frame_count == 3  # a new row layout is a new graph


@pytest.mark.slow
def test_compiled_forward_equals_eager(dit):
    """Inductor's graph against the eager module, fp32, on one batch holding every kind of row, with a
    LoRA on all ten linears of every block.

    One graph only (an inductor compile is most of a minute on a small CPU): rows 0-1 read the reference
    with a weighted read (2.5 / 0.25 per block), row 2 is a plain row in the same forward, so the plain
    path, the reading path and the mixed-row merge are all compiled and checked; the LoRA on every linear,
    the text context's k/v projections too, is what ArcAnima v2's reading sub-batch and a style LoRA add to
    the graph (tests/adapter/test_arcanima_methods.py runs v2's own forward through dynamo and AOTAutograd).
    """
    forward = compile_forward(dit)
    x, sigma, ctx = _inputs(3, 5)
    refs = _refs(dit, (True, True, False), 6, weights=(2.5, 0.25))
    loras = _every_linear_lora(dit, 7)
    with torch.inference_mode():
        compiled = forward(x, sigma, ctx, loras=loras, refs=refs)
        eager = dit(x, sigma, ctx, loras=loras, refs=refs)
        plain = dit(x, sigma, ctx, loras=loras)
        without_lora = dit(x, sigma, ctx, refs=refs)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert (eager[:2] - plain[:2]).abs().max() > 1e-3  # rows 0-1 really read
    torch.testing.assert_close(eager[2], plain[2], rtol=0, atol=1e-5)  # row 2 is a plain row
    assert (eager - without_lora).abs().max() > 1e-3  # the LoRA is in the graph
