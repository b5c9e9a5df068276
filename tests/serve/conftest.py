"""Shared by the Serve test modules (each starts its own real local Serve).

Their SnapRefClients run with retries=0: what they check is the server's behaviour, which the
client's own re-sends of calls that met a lost replica (tests/test_client.py) would otherwise mask."""

from __future__ import annotations

from snapref_ray.serve.direct_ingress import free_port  # noqa: F401  (a port on 127.0.0.1 nothing listens on)
