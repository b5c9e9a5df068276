"""The seam through which feature rows (ArcAnima, the step cache) join the GPU suite.

A row function gets a `SuiteContext` (the suite's built step bench, its arguments, the device) and returns
flat figures; `register_rows` adds it as a section of gpu_suite's JSON and Markdown. Kept apart from
gpu_suite.py so row modules need not import the suite that imports them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.snapref_steps import StepBench


@dataclass
class SuiteContext:
    """What a registered row function gets: the built bench, the arguments, the device."""

    bench: StepBench
    args: argparse.Namespace
    device: torch.device


RowFunction = Callable[[SuiteContext], dict[str, Any]]
EXTRA_ROWS: dict[str, RowFunction] = {}


def register_rows(name: str, fn: RowFunction) -> None:
    """Add a section to the suite (e.g. ArcAnima's step ratios); fn returns flat figures."""
    EXTRA_ROWS[name] = fn
