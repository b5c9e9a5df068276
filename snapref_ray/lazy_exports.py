"""A package's public names, imported from their submodules on first use (PEP 562) instead of with the package.

`snapref_ray.models`, `snapref_ray.adapter` and `snapref_ray.render_service` export names from submodules that
import torch. Imported eagerly, any process that touched one torch-free submodule of theirs (a serve
config, Serve's ingress and ReferenceStore replicas, which only parse requests and keep bytes) paid for
torch too: about 3 CPU-seconds and 200 MB resident per process.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """The module `__getattr__` of `package`: `exports` maps each public name to the submodule defining it."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        setattr(sys.modules[package], name, value)  # the next lookup finds it without this function
        return value

    return __getattr__
