"""Finding and stopping every process of a job, on this host.

Every launched process inherits ``ORCHESTRATE_JOB_ID`` from its launch script, so the job's
processes can be found by scanning ``/proc/*/environ`` even when they left their process group
or session (torchrun's workers, daemonised helpers). Names are never used: two jobs run the same
``python``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

TAG = "ORCHESTRATE_JOB_ID"


def tagged_pids(job_id: str) -> list[int]:
    """Pids of processes on this host whose environment carries the job's tag."""
    needle = f"{TAG}={job_id}".encode()
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry.name))
    return found


def signal_pids(pids: list[int], sig: int) -> None:
    """Send ``sig`` to each pid that still exists (and SIGCONT, so stopped ones can act)."""
    for pid in pids:
        for s in (sig, signal.SIGCONT) if sig != signal.SIGKILL else (sig,):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, s)


def reap(job_id: str, grace_s: float = 3.0) -> int:
    """SIGTERM every tagged process, SIGKILL what is left after ``grace_s``; returns the count."""
    pids = tagged_pids(job_id)
    if not pids:
        return 0
    signal_pids(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not tagged_pids(job_id):
            return len(pids)
        time.sleep(0.05)
    signal_pids(tagged_pids(job_id), signal.SIGKILL)
    return len(pids)
