"""Receiving request bodies from clients that may never finish sending them.

Serve's proxy hands the ingress a request as soon as its headers arrive; the body follows chunk
by chunk through `receive()`. A client that sends valid headers and then one byte every few
seconds would hold an ingress request slot for as long as it likes, and a few hundred such
clients fill every slot: health checks and well-behaved clients then get the proxy's
plain-text 503. `BodyReceiver` bounds that:

- a total deadline (`body_timeout_s`) and a minimum average rate after a grace period
  (`body_min_rate_bytes_s` after `body_grace_s`): past either, 408 in JSON;
- admission: a body that has not arrived within `fast_body_s` needs one of `max_slow_bodies`
  slow-upload slots; when none is free the ingress answers 503 + Retry-After at once. Fast
  bodies (every normal client) never need a slot, and slow ones never hold more than
  `max_slow_bodies` of the ingress's `ingress_max_ongoing_requests` slots, so health and normal
  requests keep being served while hostile clients wait or are turned away;
- size: Content-Length over the limit is refused before reading a byte, and the bytes actually
  received are counted too (a missing or lying Content-Length changes nothing);
- a client that disconnects mid-body is an info line in the log, not an error.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator

from ray.exceptions import TaskCancelledError
from starlette.requests import Request

from snapref_ray.serve.config import ServeConfig
from snapref_ray.serve.errors import ApiError

# Under "ray.serve" so the line lands in the replica's Serve log at INFO (Serve configures that tree;
# a module logger would propagate to the root logger, which drops INFO).
log = logging.getLogger("ray.serve.snapref.bodies")


class ClientGone(ApiError):
    """The client closed the connection before its body was complete: nobody reads the answer."""

    def __init__(self, field: str) -> None:
        super().__init__(400, field, "the client disconnected before sending the whole body")


class BodyReceiver:
    """Deadlines, minimum rate and slow-upload admission for request bodies (one per ingress replica)."""

    def __init__(self, config: ServeConfig) -> None:
        self._config = config
        self.slow_in_progress = 0  # bodies holding a slow-upload slot right now
        self.slow_refused = 0

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(math.ceil(self._config.retry_after_s))}

    async def chunks(self, request: Request, limit: int, field: str) -> AsyncIterator[bytes]:
        """The body's chunks as they arrive, within the deadlines and `limit` bytes (413 past it)."""
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise ApiError(400, "Content-Length", f"not an integer: {declared[:64]!r}") from None
            if size > limit:
                raise ApiError(413, field, f"the body is {size} bytes, more than the {limit} accepted")
        c = self._config
        start = time.monotonic()
        fast_until = start + c.fast_body_s
        received, slow = 0, False
        try:
            while True:
                rate_deadline = (
                    start + c.body_grace_s + received / c.body_min_rate_bytes_s
                    if c.body_min_rate_bytes_s > 0
                    else math.inf
                )
                deadline = min(start + c.body_timeout_s, rate_deadline)
                wait_until = deadline if slow else min(deadline, fast_until)
                try:
                    message = await asyncio.wait_for(request.receive(), max(0.0, wait_until - time.monotonic()))
                except TaskCancelledError:
                    # Serve's proxy saw the client go and cancelled the call that relays its body.
                    message = {"type": "http.disconnect"}
                except TimeoutError:
                    if not slow and wait_until == fast_until and fast_until < deadline:
                        slow = self._admit_slow(field)
                        continue
                    raise self._too_slow(field, received, time.monotonic() - start) from None
                if message["type"] == "http.disconnect":
                    log.info(
                        "client disconnected after %d body bytes (%s %s)", received, request.method, request.url.path
                    )
                    raise ClientGone(field)
                chunk = message.get("body", b"")
                received += len(chunk)
                if received > limit:
                    raise ApiError(413, field, f"the body exceeds the {limit} bytes accepted")
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    return
        finally:
            if slow:
                self.slow_in_progress -= 1

    async def read(self, request: Request, limit: int, field: str) -> bytes:
        """The whole body (see `chunks`)."""
        return b"".join([chunk async for chunk in self.chunks(request, limit, field)])

    def _admit_slow(self, field: str) -> bool:
        if self.slow_in_progress >= self._config.max_slow_bodies:
            self.slow_refused += 1
            raise ApiError(
                503,
                field,
                f"the body did not arrive within {self._config.fast_body_s:g} s and"
                f" {self.slow_in_progress} slow uploads are already in progress;"
                " retry after the Retry-After delay",
                headers=self._retry_after(),
            )
        self.slow_in_progress += 1
        return True

    def _too_slow(self, field: str, received: int, elapsed: float) -> ApiError:
        c = self._config
        if elapsed >= c.body_timeout_s - 1e-3:
            why = f"not complete within body_timeout_s={c.body_timeout_s:g} s"
        else:
            why = f"arriving slower than {c.body_min_rate_bytes_s:g} bytes/s"
        return ApiError(408, field, f"the request body was {why} ({received} bytes in {elapsed:.1f} s)")
