"""The DiT forward has no device read-backs and compiles to graphs that prompts and references reuse.

The forward is compiled regionally (models/compiled.py): one graph of the block serves every block, so
the counts below are graphs of the block, and a two-block model that compiles one graph has shared it.

`torch.compile(fullgraph=True)` refuses a graph break, and a device-to-host read in the forward
(`.item()`, `bool(tensor)`, boolean indexing: data-dependent control flow or shapes) is one, so
tracing a whole forward with fullgraph is the CPU stand-in for `torch.cuda.set_sync_debug_mode`
(which the same tests also switch to "error" when CUDA is there).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from snapref_ray.models.attention import RefRead
from snapref_ray.models.compile_cache import CompileCache, CompileKey
from snapref_ray.models.compiled import compile_forward
from snapref_ray.models.dit import load_dit
from snapref_ray.models.dit_config import BLOCK_LINEARS
from snapref_ray.models.fp8 import quantize_dit
from snapref_ray.models.ops import LoRAPair
from snapref_ray.models.tiny_dit import make_tiny_dit_state_dict
from snapref_ray.storage.backends import open_storage

BLOCKS, WIDTH, HEAD_DIM, CONTEXT = 2, 64, 32, 64


def make_dit(dtype: torch.dtype | None = None):
    return load_dit(
        make_tiny_dit_state_dict(
            model_channels=WIDTH, num_blocks=BLOCKS, head_dim=HEAD_DIM, context_dim=CONTEXT, seed=3
        ),
        dtype=dtype,
    )


@pytest.fixture(scope="module")
def dit():
    return make_dit()


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
def test_batch_sizes_one_to_four_share_the_plain_graph_and_add_none_after_warm_up(dit):
    """Rows that read nothing run one graph for every batch size (the batch dimension is dynamic, batch 1
    included); a reading layout has its own graph per row count, built once at warm-up and then reused."""
    counter = CompileCounter()
    forward = compile_forward(dit, backend=counter)
    with torch.inference_mode():
        for rows in (1, 2, 3, 4):
            x, sigma, ctx = _inputs(rows, rows)
            torch.testing.assert_close(forward(x, sigma, ctx), dit(x, sigma, ctx), rtol=0, atol=0)
        assert counter.frame_count == 1, "a batch size of plain rows built its own graph"
        for rows in (3, 4):  # the warm-up of a job's reading layouts (every row reads): its tail and full batch
            forward(*_inputs(rows, 10 + rows), refs=_refs(dit, (True,) * rows, 20 + rows))
        warmed = counter.frame_count
        assert warmed == 1 + 2
        for rows in (4, 3):  # the job's batches after warm-up: nothing new
            x, sigma, ctx = _inputs(rows, 30 + rows)
            refs = _refs(dit, (True,) * rows, 40 + rows)
            torch.testing.assert_close(forward(x, sigma, ctx, refs=refs), dit(x, sigma, ctx, refs=refs), rtol=0, atol=0)
        for rows in (4, 3, 2, 1):
            forward(*_inputs(rows, 50 + rows))
        assert counter.frame_count == warmed
        # A reference of another aspect ratio (more tokens) reads through the same graph.
        kv = dit.reference_kv(torch.randn(1, 16, 1, 6, 10), torch.randn(1, 12, CONTEXT), rope_offset=(0, 0, 3))
        x, sigma, ctx = _inputs(3, 60)
        wide = [RefRead(k, v, (True,) * 3, 1.0) for k, v in kv]
        assert wide[0].k_HLD.shape[1] != _refs(dit, (True,) * 3, 0)[0].k_HLD.shape[1]
        torch.testing.assert_close(forward(x, sigma, ctx, refs=wide), dit(x, sigma, ctx, refs=wide), rtol=0, atol=0)
        assert counter.frame_count == warmed

    static = CompileCounter()  # the oracle: without the dynamic batch, every batch size is a graph
    forward = compile_forward(dit, backend=static, dynamic_batch=False)
    with torch.inference_mode():
        for rows in (2, 3):
            forward(*_inputs(rows, rows))
    assert static.frame_count == 2


@pytest.mark.slow
def test_fp8_and_pilot_frames_through_the_compiled_block_equal_eager():
    """fp8 block linears (bf16 compute) and the pilot's two-frame latents with a LoRA on every linear run
    through the one block graph exactly as the eager module runs them (the captured graph, run as is)."""
    fp8 = make_dit(torch.bfloat16)
    quantize_dit(fp8, "fp8")
    counter = CompileCounter()
    forward = compile_forward(fp8, backend=counter)
    x, sigma, ctx = _inputs(3, 50)
    refs = _refs(fp8, (True, True, False), 51)
    with torch.inference_mode():
        compiled = forward(x.bfloat16(), sigma, ctx.bfloat16(), refs=refs)
        eager = fp8(x.bfloat16(), sigma, ctx.bfloat16(), refs=refs)
    assert counter.frame_count == 1
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)

    plain = make_dit()
    counter = CompileCounter()
    forward = compile_forward(plain, backend=counter)
    two_frames = torch.randn(2, 16, 2, 8, 6, generator=torch.Generator().manual_seed(52))  # [target, reference]
    _, sigma, ctx = _inputs(2, 53)
    loras = _every_linear_lora(plain, 54)
    with torch.inference_mode():
        compiled = forward(two_frames, sigma, ctx, loras=loras)
        eager = plain(two_frames, sigma, ctx, loras=loras)
        without_lora = plain(two_frames, sigma, ctx)
    assert counter.frame_count == 1
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    assert (eager - without_lora).abs().max() > 1e-3


# The second process of the compile-cache test: the same model and inputs, an empty local inductor cache,
# the shared compile cache; prints what it compiled and saves its output.
_SECOND_PROCESS = """
import json, sys, torch
from torch._dynamo.utils import counters
from snapref_ray.models.compile_cache import CompileCache, CompileKey
from snapref_ray.models.compiled import compile_forward
from snapref_ray.storage.backends import open_storage
from tests.models.test_compiled import compiled_case, make_dit
dit = make_dit()
cache = CompileCache(sys.argv[1], CompileKey.for_dit(dit, "none"), open_store=open_storage)
forward = compile_forward(dit, cache=cache)
with torch.inference_mode():
    out = compiled_case(dit, forward)
torch.save(out, sys.argv[2])
print(json.dumps({"built": forward.stats.built, "loaded": forward.stats.loaded,
                  "misses": counters["inductor"]["fxgraph_cache_miss"],
                  "artifacts": forward.stats.artifacts_loaded}))
"""


def compiled_case(dit, forward, **kwargs):
    """The inductor test's forward: rows 0-1 read with weighted reads, row 2 plain, a LoRA on every linear."""
    x, sigma, ctx = _inputs(3, 5)
    refs = _refs(dit, (True, True, False), 6, (2.5, 0.25))
    return forward(x, sigma, ctx, loras=_every_linear_lora(dit, 7), refs=refs)


@pytest.mark.slow
def test_compiled_forward_equals_eager_and_a_new_node_loads_it_from_the_compile_cache(dit, tmp_path: Path):
    """Inductor's graph against the eager module, fp32, on one batch holding every kind of row, with a
    LoRA on all ten linears of every block.

    One graph only (an inductor compile is most of a minute on a small CPU): rows 0-1 read the reference
    with a weighted read (2.5 / 0.25 per block), row 2 is a plain row in the same forward, so the plain
    path, the reading path and the mixed-row merge are all compiled and checked; the LoRA on every linear,
    the text context's k/v projections too, is what ArcAnima v2's reading sub-batch and a style LoRA add to
    the graph (tests/adapter/test_arcanima_methods.py runs v2's own forward through dynamo and AOTAutograd).
    """
    shared = tmp_path / "compile-cache"
    forward = compile_forward(dit, cache=CompileCache(shared, CompileKey.for_dit(dit, "none"), open_store=open_storage))
    x, sigma, ctx = _inputs(3, 5)
    refs = _refs(dit, (True, True, False), 6, weights=(2.5, 0.25))
    loras = _every_linear_lora(dit, 7)
    with torch.inference_mode():
        compiled = compiled_case(dit, forward)
        eager = dit(x, sigma, ctx, loras=loras, refs=refs)
        plain = dit(x, sigma, ctx, loras=loras)
        without_lora = dit(x, sigma, ctx, refs=refs)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert (eager[:2] - plain[:2]).abs().max() > 1e-3  # rows 0-1 really read
    torch.testing.assert_close(eager[2], plain[2], rtol=0, atol=1e-5)  # row 2 is a plain row
    assert (eager - without_lora).abs().max() > 1e-3  # the LoRA is in the graph

    # Published once: the graph went to the shared cache; two workers racing to publish one name leave
    # one complete artifact (the loser is told), and a process with nothing new publishes nothing.
    assert forward.stats.graphs == 1 and forward.stats.published == 1
    (artifact,) = (shared / CompileKey.for_dit(dit, "none").digest).iterdir()
    raced = tmp_path / "raced"
    racers = [CompileCache(raced, CompileKey.for_dit(dit, "none"), open_store=open_storage) for _ in range(2)]
    wins: list[bool] = []
    threads = [threading.Thread(target=lambda c=c: wins.append(c.publish("same-shape"))) for c in racers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins) == [False, True]
    assert [p.name for p in (raced / racers[0].key.digest).iterdir()] == ["same-shape.megacache"]
    assert racers[0].publish("same-shape") is False  # nothing new since

    # A new node: an empty local inductor cache and the shared compile cache: nothing is built, the graph
    # comes from the cache and computes the same numbers.
    out_file = tmp_path / "second.pt"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty-inductor-cache"), "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", _SECOND_PROCESS, str(shared), str(out_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    second = json.loads(done.stdout.strip().splitlines()[-1])
    assert second == {"built": 0, "loaded": 1, "misses": 0, "artifacts": 1}, (second, artifact.name)
    torch.testing.assert_close(torch.load(out_file), compiled, rtol=0, atol=0)
