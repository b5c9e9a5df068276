"""Ray's token-auth warning, said as what it means.

Every start of a local Ray (a job from the command line, `snapref-ray serve`) prints "Token authentication is
enabled ... Set RAY_AUTH_MODE=disabled to opt out", which reads like something to act on. Both doors rewrite it
into one INFO line; it lives here, below both, so the server does not reach the batch job's console for it.
"""

from __future__ import annotations

import logging

_TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"
_TOKEN_WARNING = "Token authentication is enabled for this Ray cluster"
TOKEN_NOTE = (
    "Ray's token authentication is on for the local Ray this command started (Ray 2.60's default; the token is in"
    " ~/.ray/auth_token): it guards Ray's own ports, nothing needs doing. Joining a cluster needs"
    " RAY_AUTH_MODE=token (docs/clusters.md)."
)


class _ExplainTokenWarning(logging.Filter):
    """Ray's "Token authentication is enabled ... Set RAY_AUTH_MODE=disabled to opt out" warning, which every start
    of a local Ray prints and which reads like something to act on, as the INFO line that says what it means."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(_TOKEN_WARNING):
            record.msg, record.args = TOKEN_NOTE, ()
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def explain_ray_token_warning() -> None:
    """Rewrite Ray's token-auth warning into TOKEN_NOTE from now on (idempotent)."""
    logger = logging.getLogger(_TOKEN_LOGGER)
    if not any(isinstance(f, _ExplainTokenWarning) for f in logger.filters):
        logger.addFilter(_ExplainTokenWarning())
