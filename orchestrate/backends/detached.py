"""Detached supervisors: the process that watches a job's ranks, started and stopped from the CLI.

The local and SSH backends run each job under a supervisor process of its own, started in a new
session so that it outlives the ``submit`` that started it (``--detach``, a closed terminal).
This module is the plumbing they share: starting one, knowing whether it still runs, and
stopping it (SIGTERM, wait until the store says the job ended, SIGKILL as a last resort).
A supervisor is identified by its pid *and* its command line naming the job id, so a reused pid
is never mistaken for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrate.core.layout import SUPERVISOR_LOG
from orchestrate.hostside.shipping import shipped
from orchestrate.run.store import JobRecord, Store


def start(module: str, job_id: str, store: Store, run_dir: Path, *, pipe: bool = False,
          cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``python -m MODULE JOB_ID STORE_PATH`` in its own session, logging to the run
    dir's supervisor log; with ``pipe`` its stdin and stdout are pipes to this process."""
    with open(run_dir / SUPERVISOR_LOG, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", module, job_id, str(store.path)],
            stdin=subprocess.PIPE if pipe else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipe else log, stderr=log,
            start_new_session=True, cwd=cwd,
        )


def alive(pid: int | None, job_id: str) -> bool:
    """Whether ``pid`` is still the supervisor of ``job_id`` (guards against pid reuse)."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust the pid
    return job_id.encode() in cmdline.split(b"\0")


def on_this_machine(job: JobRecord) -> bool:
    """Whether the job's supervisor runs (or ran) on this machine."""
    import socket

    return job.supervisor_host in (None, socket.gethostname())


def stop(job: JobRecord, store: Store, wait_s: float) -> bool:
    """SIGTERM the job's supervisor and wait up to ``wait_s`` for it to record the end; SIGKILL
    it if it does not. True when it ended the job itself (its ranks stopped its way)."""
    pid = job.supervisor_pid
    if pid is None or not on_this_machine(job) or not alive(pid, job.id):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and alive(pid, job.id):
        current = store.get(job.id)
        if current is not None and current.terminal:
            return True
        time.sleep(0.05)
    if alive(pid, job.id):
        os.kill(pid, signal.SIGKILL)
        return False
    current = store.get(job.id)
    return current is not None and current.terminal


def start_watchdog(pid: int, job_id: str, grace_s: float) -> subprocess.Popen[bytes]:
    """A tiny process that outlives ``pid`` (a supervisor) by at most a grace period: when it
    ends, however it ends, the watchdog stops whatever the job left on this machine and drops
    its lease (:func:`orchestrate.hostside.host.watch`). Standard library only, no site-packages."""
    from orchestrate.hostside.host import TAG, proc_start

    text = shipped("watchdog", "from orchestrate.hostside.host import watch\n"
                   f"watch({pid}, {proc_start(pid)!r}, {job_id!r}, {grace_s!r})")
    # Untagged, or it would count as a process of the job and keep the job's lease alive.
    env = {k: v for k, v in os.environ.items() if k != TAG}
    return subprocess.Popen(
        [sys.executable, "-S", "-c", text], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env,
    )
