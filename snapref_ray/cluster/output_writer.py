"""Image outputs written off the device's critical path: encode, thumbnail, upload, metadata row.

A worker samples a batch holding its device lock, hands the images to an `OutputWriter` and
releases the lock; the writer's threads PNG/JPEG-encode, upload and build the Parquet rows while
the next batch samples (the actor runs two calls at once, `max_concurrency=2`). Pillow's
encoders and boto3's sockets release the GIL, so a few threads encode and upload several images
at once without slowing the sampling thread down much. With `threads=0` the writer runs every
store inline, in the caller, before the device lock is released: the device waits for the I/O
(the configuration to compare against; `benchmarks/orchestration.py --overlap both`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class OutputWriter:
    """A small pool of output threads; `threads=0` writes inline (no overlap)."""

    def __init__(self, threads: int) -> None:
        if threads < 0:
            raise ValueError(f"output_threads must be >= 0, got {threads}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="output") if threads else None

    @property
    def overlaps(self) -> bool:
        """True when stores run on the pool, after the device is released."""
        return self._pool is not None

    def submit_all(self, stores: Sequence[Callable[[], T]]) -> list[Future]:
        """Start every store; with no pool each runs now, in this thread (its result or error in the future)."""
        if self._pool is not None:
            return [self._pool.submit(store) for store in stores]
        futures = []
        for store in stores:
            future: Future = Future()
            try:
                future.set_result(store())
            except BaseException as e:
                future.set_exception(e)
            futures.append(future)
        return futures

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


__all__ = ["OutputWriter"]
