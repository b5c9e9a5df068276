"""The API's error answer, on both sides of the wire: `{"error": {"field": ..., "message": ...}}` + status.

The server raises `ApiError` wherever a request goes wrong (ingress, renderer replica) and answers with it;
`SnapRefClient` raises the same class for a non-2xx answer, so a caller reads `status`, `field`, `message`
and `retry_after` whichever side it is on. Importing this module imports nothing of Ray or FastAPI.
"""

from __future__ import annotations

import math
from typing import Any

TOKEN_ENV = "SNAPREF_API_TOKEN"  # the bearer token, for the server (when its config sets none) and the client


class ApiError(Exception):
    """An HTTP error answer: status, the field at fault (None if no single one), a message, extra headers."""

    def __init__(self, status: int, field: str | None, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, field, message, headers)  # all in args, so it pickles across replicas
        self.status, self.field, self.message, self.headers = status, field, message, dict(headers or {})

    def __str__(self) -> str:
        return f"{self.status} {self.field}: {self.message}" if self.field else f"{self.status}: {self.message}"

    @property
    def retry_after(self) -> float | None:
        """Seconds the answer asks the client to wait before it tries again (Retry-After), if it says."""
        value = self.headers.get("Retry-After")
        try:
            return float(value) if value is not None else None
        except ValueError:
            return None

    def body(self) -> dict:
        return {"error": {"field": self.field, "message": self.message}}


def non_finite_refusal(value: Any, token: str | None = None, *, why: str = "") -> str | None:
    """The message that refuses NaN or Infinity sent as a number; None for anything else (a finite number, a
    string). `token` is how the client spelled it, where the parser kept it ("-Infinity"); `why` is added after
    "accepts". JSON and form fields both go through here, so every door refuses them with one sentence."""
    if not isinstance(value, float) or math.isfinite(value):
        return None
    token = token or ("NaN" if math.isnan(value) else "Infinity")
    return f"{token} is not a number this API accepts{why}; send a finite number"
