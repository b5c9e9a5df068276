"""The driver's heap as it stands when a job starts, marked static for the job (`gc.freeze`), as vLLM's engine core
does after its start-up.

A driver holds ~300,000 objects before its first item (the imports: torch, Ray, pyarrow, pydantic). Python's
oldest-generation collection walks every one of them each time the job's own long-lived objects have grown by a
quarter (rows held in open shards, a plan's items, the scheduler's records), and a job of a few thousand items sets
off one or two of them during its planning and its loop: 0.31 of a 6,000-item webdataset job's 2.8 driver CPU-s
(benchmarks/driver_scale.py; docs/performance.md). Frozen, those objects are left out of every collection until the
job ends; the job's own objects are collected as before, and reference counting frees anything as it always does.
Nothing is collected first (that would be one full collection more): cyclic garbage made before the job waits for
its end.

`static_heap()` nests (a job's loop inside the job) and is process-wide: the heap is unfrozen when the outermost one
ends, however it ends.
"""

from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0


class static_heap(contextlib.ContextDecorator):  # a lower-case name: used as `with static_heap()` and `@static_heap()`
    """Freeze the process's GC-tracked objects while the outermost `with static_heap()` runs (see the module
    docstring)."""

    def __enter__(self) -> static_heap:
        global _depth
        with _lock:
            if _depth == 0:
                gc.freeze()
            _depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        global _depth
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()  # back into the oldest generation: collectable again
