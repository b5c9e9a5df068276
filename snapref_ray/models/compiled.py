"""The DiT forward with its transformer block compiled once and run for every block (regional compile).

`compile_forward(dit)` returns a `RegionalForward`, a callable with `AnimaDiT.forward`'s signature.
What runs between the blocks (patchify, the timestep and patch embedders, RoPE, the final layer) is
eager: a few small ops per step. The block is what costs, and all 28 (or 40) blocks are the same code
over different weights, so one function `run_block(block, x, t, context, rope, lora, ref)` is compiled
with `fullgraph=True` (a graph break, e.g. a device read-back, is an error, not a silent slow path) and
called for each block with that block as an argument: its weights are graph inputs, not constants, so
every block reuses one graph. Building it costs one block's compile instead of the whole model's
(diffusers' `compile_repeated_blocks`, vLLM-Omni's default).

What selects a graph (each built once, at warm-up or on its first call; cached per cluster with a
`CompileCache`):
- the token count (the resolution; the pilot's two frames), the context length, the dtype;
- which rows read the reference (host tuples in `RefRead`), and so, for reading blocks, the number of
  rows; whether the block has a LoRA branch and on which linears (SnapRef's target LoRAs, ArcAnima's).
What does not: prompts, seeds, sigma, the reference's content and its token count (its aspect ratio and
size: that dimension is marked dynamic), read weights and LoRA strengths (floats are not specialised),
which block runs (the weights are inputs) and, in blocks that read no reference, the batch: its dimension
is marked dynamic (unbacked, so batch 1 shares it too), so 1..max_batch rows share one graph. A block
that reads keeps a static row count: its reading rows are host data that slice the batch
(models/attention.py), so each (rows, reading rows) layout of a reading block is its own graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from snapref_ray.models.attention import RefRead
from snapref_ray.models.compile_cache import CompileCache
from snapref_ray.models.dit import AnimaDiT, DiTBlock, Rope, TimeEmbedding
from snapref_ray.models.ops import BlockLoRA

log = logging.getLogger(__name__)

# Graphs per compiled block function before dynamo gives up and runs eager: resolutions x row layouts x
# reference sizes of a long job. Dynamo's default (8) is meant for training loops of one shape.
RECOMPILE_LIMIT = 64


@dataclass
class CompileStats:
    """What compiling cost this process: graphs built by inductor vs loaded from a cache, and the seconds.

    `compile_s` is the wall time of the forwards that produced a new graph (tracing, and the build or
    the cache load); `cache_load_s` the time reading the shared compile cache before the first compile.
    """

    graphs: int = 0  # new graphs dynamo captured
    built: int = 0  # ... that inductor compiled (an FX-graph cache miss)
    loaded: int = 0  # ... that came from a cache (the shared compile_cache or the local inductor cache)
    compile_s: float = 0.0
    cache_load_s: float = 0.0
    artifacts_loaded: int = 0
    artifacts_skipped: int = 0
    published: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def _run_block(
    block: DiTBlock,
    x_BLD: torch.Tensor,
    t: TimeEmbedding,
    context_BSC: torch.Tensor,
    rope: Rope,
    lora: BlockLoRA | None,
    ref: RefRead | None,
    cross_attention: bool,
) -> torch.Tensor:
    return block(x_BLD, t, context_BSC, rope, lora=lora, ref=ref, cross_attention=cross_attention)


class RegionalForward:
    """`dit.forward` whose blocks run one compiled graph (see the module docstring)."""

    def __init__(
        self,
        dit: AnimaDiT,
        *,
        mode: str | None = None,
        backend: str | Callable = "inductor",
        cache: CompileCache | None = None,
        dynamic_batch: bool = True,  # False: every batch size and reference size is its own graph (an oracle)
    ) -> None:
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
        self.dit = dit
        self.cache = cache
        self.dynamic_batch = dynamic_batch
        self.stats = CompileStats()
        self.block = torch.compile(_run_block, fullgraph=True, dynamic=False, mode=mode, backend=backend)
        self._cache_loaded = False

    def __call__(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor | float,
        context: torch.Tensor,
        *,
        loras: Sequence[BlockLoRA | None] | None = None,
        refs: Sequence[RefRead | None] | None = None,
    ) -> torch.Tensor:
        if not self._cache_loaded:
            self._load_cache()
        graphs, misses, hits = _graph_counters()
        t0 = time.perf_counter()
        out = self.dit(x, sigma, context, loras=loras, refs=refs, run_block=self.run_block)
        new_graphs = _graph_counters()[0] - graphs
        if new_graphs:
            self._count_compile(new_graphs, misses, hits, time.perf_counter() - t0, x, context, refs)
        return out

    def run_block(
        self,
        block: DiTBlock,
        x_BLD: torch.Tensor,
        t: TimeEmbedding,
        context_BSC: torch.Tensor,
        rope: Rope,
        lora: BlockLoRA | None,
        ref: RefRead | None,
        cross_attention: bool,
    ) -> torch.Tensor:
        """One block through the compiled graph: the batch dynamic where no row reads, the reference's token
        count dynamic where rows read."""
        if self.dynamic_batch:
            if ref is None or not ref.reading:
                for tensor in (x_BLD, t.emb, t.adaln_lora, context_BSC):
                    torch._dynamo.decorators.mark_unbacked(tensor, 0)
            else:  # references of another aspect ratio or size: the same graph
                torch._dynamo.decorators.mark_unbacked(ref.k_HLD, 1)
                torch._dynamo.decorators.mark_unbacked(ref.v_HLD, 1)
        return self.block(block, x_BLD, t, context_BSC, rope, lora, ref, cross_attention)

    def _load_cache(self) -> None:
        self._cache_loaded = True
        if self.cache is None:
            return
        t0 = time.perf_counter()
        found = self.cache.load()
        self.stats.cache_load_s += time.perf_counter() - t0
        self.stats.artifacts_loaded += len(found.loaded)
        self.stats.artifacts_skipped += len(found.skipped)

    def _count_compile(self, new_graphs, misses, hits, seconds, x, context, refs) -> None:
        _, misses_now, hits_now = _graph_counters()
        built = misses_now - misses
        self.stats.graphs += new_graphs
        self.stats.built += built
        self.stats.loaded += hits_now - hits
        self.stats.compile_s += seconds
        log.info(
            "DiT block graphs: %d new (%d built, %d from cache) in %.1f s", new_graphs, built, hits_now - hits, seconds
        )
        if self.cache is not None and self.cache.publish(shape_key(x, context, refs)):
            self.stats.published += 1


def shape_key(x: torch.Tensor, context: torch.Tensor, refs: Sequence[RefRead | None] | None) -> str:
    """A readable name of the graphs a forward of these inputs selects (the artifact's name in the cache)."""
    *_, h, w = x.shape
    frames = x.shape[2] if x.ndim == 5 else 1
    reads = [r for r in refs or () if r is not None and r.reading]
    layout = f"-reads{len(reads)}of{reads[0].num_rows}rows-ref{reads[0].k_HLD.shape[1]}" if reads else ""
    return f"latent{frames}x{h}x{w}-ctx{context.shape[1]}{layout}"


def _graph_counters() -> tuple[int, int, int]:
    """(graphs dynamo captured, FX-graph cache misses = inductor builds, hits) in this process so far."""
    # Imported here, when something is compiled: torch._dynamo costs ~1 CPU-s to import, and every process that
    # renders uncompiled (a CPU worker, a driver importing the worker's class) would pay it for nothing.
    from torch._dynamo.utils import counters

    return (
        counters["stats"]["unique_graphs"],
        counters["inductor"]["fxgraph_cache_miss"],
        counters["inductor"]["fxgraph_cache_hit"],
    )


def compile_forward(
    dit: AnimaDiT,
    *,
    mode: str | None = None,
    backend: str | Callable = "inductor",
    cache: CompileCache | None = None,
    dynamic_batch: bool = True,
) -> RegionalForward:
    """dit.forward with a regionally compiled block (the module docstring); `mode`, `backend`: torch.compile's."""
    return RegionalForward(dit, mode=mode, backend=backend, cache=cache, dynamic_batch=dynamic_batch)


__all__ = ["RECOMPILE_LIMIT", "CompileStats", "RegionalForward", "compile_forward", "shape_key"]
