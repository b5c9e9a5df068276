"""Shared by the Serve test modules (each starts its own real local Serve)."""

from __future__ import annotations

from snapref_ray.serve.direct_ingress import free_port  # noqa: F401  (a port on 127.0.0.1 nothing listens on)
