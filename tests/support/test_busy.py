"""The suite's burners (``--cpu-load``) never outlive the pytest that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.process

_STARTER = """
import time
from tests.support.busy import Burners
burners = Burners(2)
print(" ".join(str(p.pid) for p in burners.procs), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_burners_end_when_the_run_that_started_them_is_killed() -> None:
    """A run killed with SIGKILL runs no cleanup: its burners see their parent gone and end."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    starter = subprocess.Popen([sys.executable, "-c", _STARTER], cwd=root,
                               stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": root})
    assert starter.stdout is not None
    pids = [int(p) for p in starter.stdout.readline().split()]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    starter.send_signal(signal.SIGKILL)
    starter.wait()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"burners {left} outlived their run"
