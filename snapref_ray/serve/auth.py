"""Bearer-token check for the HTTP API.

The token is compared in constant time (`hmac.compare_digest`) so response timing tells an
attacker nothing about how much of a guess was right, and it never appears in an error
message, a log line or a repr (the config holds it as a SecretStr).
"""

from __future__ import annotations

import hmac

from snapref_ray.serve.errors import ApiError

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="snapref-ray"'}


class BearerAuth:
    """Checks `Authorization: Bearer <token>`; with no token configured every request passes."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def __repr__(self) -> str:  # never the token itself
        return f"BearerAuth(enabled={self.enabled})"

    def check(self, authorization: str | None) -> None:
        """Raise a 401 ApiError unless `authorization` carries the configured token."""
        if self._token is None:
            return
        if not authorization:
            raise ApiError(
                401,
                "Authorization",
                "missing bearer token: send the header 'Authorization: Bearer <token>'",
                headers=_CHALLENGE,
            )
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise ApiError(
                401, "Authorization", "the Authorization header must be 'Bearer <token>'", headers=_CHALLENGE
            )
        if not hmac.compare_digest(value.strip().encode(), self._token):
            raise ApiError(401, "Authorization", "invalid bearer token", headers=_CHALLENGE)
