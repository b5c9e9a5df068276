"""The DiT forward through torch.compile: one static graph per shape bucket, no graph breaks.

`compile_forward(dit)` returns a callable with `AnimaDiT.forward`'s signature. It is compiled
with `fullgraph=True` (a graph break — e.g. a device read-back in the forward — is an error, not a
silent slow path) and `dynamic=False`: every input shape gets its own specialised graph, which
on a GPU is what lets inductor pick tile sizes and, with `mode="max-autotune"`, CUDA graphs.

What selects a graph (and so compiles once, at warm-up or on the first batch of its kind):
the resolution, the number of rows (batch x row kinds of the step), which rows read the
reference (host tuples in `RefRead`), the blocks that read (the mode's zero weights) and the
reference's token count. What does not: prompts, seeds, sigma, the reference's content (same
size), the read weights (floats are not specialised: `torch._dynamo.config.specialize_float`
is False in torch >= 2.6) — pinned by tests/models/test_compiled.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Graphs per compiled forward before dynamo gives up and runs eager: resolutions x row layouts x
# reference sizes of a long job. Dynamo's default (8) is meant for training loops of one shape.
RECOMPILE_LIMIT = 64


def compile_forward(
    dit: torch.nn.Module, *, mode: str | None = None, backend: str | Callable = "inductor"
) -> Callable[..., torch.Tensor]:
    """dit.forward compiled (see the module docstring); `mode` and `backend` are torch.compile's."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
    return torch.compile(dit.forward, fullgraph=True, dynamic=False, mode=mode, backend=backend)


__all__ = ["RECOMPILE_LIMIT", "compile_forward"]
