"""The schedule's policy runs without Ray and without torch: a test of it needs no cluster and no GPU stack, and the
driver's decisions stay apart from how calls travel (docs/design.md#scheduling-and-the-refkv-hand-off)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# The modules that decide (which batch goes where, what a failure costs, which shard settles): none may import the
# runtime they decide for.
POLICY_MODULES = (
    "snapref_ray.cluster.placement",
    "snapref_ray.cluster.shard_ledger",
    "snapref_ray.cluster.call_records",
    "snapref_ray.cluster.recovery",
    "snapref_ray.cluster.members",
    "snapref_ray.cluster.batch_policy",
    "snapref_ray.cluster.scheduling_policy",
    "snapref_ray.jobs.identity_eval_policy",
    "snapref_ray.cluster.scheduler_config",
    "snapref_ray.cluster.scheduler_stats",
    "snapref_ray.cluster.scheduler_events",
    "snapref_ray.render_service.batching",
)

# Importing a blocked module raises at once, so any path to it (direct or through another module) fails the test;
# the modules' own names are printed so a failure says which one pulled it in.
_BLOCKED_IMPORT = """
import importlib, sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"ray", "torch"}:
            raise ImportError(f"blocked: {name}")
        return None

sys.meta_path.insert(0, Blocked())
for name in sys.argv[1:]:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in {"ray", "torch"})
assert not leaked, leaked
"""


@pytest.mark.parametrize("module", POLICY_MODULES)
def test_policy_module_imports_neither_ray_nor_torch(module: str) -> None:
    done = subprocess.run([sys.executable, "-c", _BLOCKED_IMPORT, module], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_block_catches_an_import_of_ray() -> None:
    """The check itself can fail: a module that imports Ray is refused."""
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORT, "snapref_ray.cluster.calls"], capture_output=True, text=True
    )
    assert done.returncode != 0 and "blocked: ray" in done.stderr
