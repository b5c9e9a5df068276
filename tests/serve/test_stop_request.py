"""`snapref-ray serve` stops on Ctrl-C or SIGTERM, however many arrive and however close together.

Each test runs in a subprocess of its own: signal handlers are per process, and pytest's are not to be touched.
"""

from __future__ import annotations

import subprocess
import sys

from tests.doc_blocks import REPO

# A burst from another process lands while a handler runs, so a second handler starts inside the first (Python
# runs both on the main thread): a handler that took a lock deadlocked there and the server never stopped.
BURST = """
import os, signal, subprocess, sys
from snapref_ray.serve.cli import StopRequest

stop = StopRequest()
stop.on_signals()
sender = subprocess.Popen(
    [sys.executable, "-c", f"import os, signal\\nfor _ in range(20000): os.kill({os.getpid()}, signal.{name})"]
)
stop.wait()
sender.wait()
print("stopped", stop.asked)
"""


def _stops(signal_name: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", BURST.replace("{name}", signal_name)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,  # a hang guard: the stop takes well under a second
    )
    assert (done.returncode, done.stdout.strip()) == (0, "stopped True"), done.stderr[-2000:]


def test_a_burst_of_ctrl_c_stops_the_server_without_a_deadlock():
    _stops("SIGINT")


def test_a_burst_of_sigterm_stops_the_server_without_a_deadlock():
    _stops("SIGTERM")
