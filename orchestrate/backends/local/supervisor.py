"""The local supervisor process: ``python -m orchestrate.backends.local.supervisor JOB STORE``.

Started detached by :class:`~orchestrate.backends.local.backend.LocalBackend`; reads the job's plan
from the store, starts one ``bash launch-<node>.sh LOCAL_RANK`` per rank (the script ``render``
prints)
and runs them to the end with the shared loop of :mod:`orchestrate.run.supervise`. Before the first
rank starts it starts a watchdog (:func:`orchestrate.backends.detached.start_watchdog`), so that
ranks never outlive a supervisor that is killed, even with SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from orchestrate.backends.base import STOP_GRACE_S
from orchestrate.backends.detached import start_watchdog
from orchestrate.core.layout import node_script_name
from orchestrate.core.plan.outcome import Exit
from orchestrate.core.plan.plan import Plan, checkpoint_dir
from orchestrate.core.plan.rankenv import ATTEMPT_VAR
from orchestrate.core.plan.restart import progress_marker
from orchestrate.diagnosis.hangwatch import RunDirEvidence
from orchestrate.hostside import host
from orchestrate.run.store import SUPERVISOR_PATIENCE_S, Store
from orchestrate.run.supervise import Launched, StopRequest, run_with_restarts


class LocalRank:
    """One rank as a local process in its own process group."""

    def __init__(self, rank: int, node: str, local_rank: int, script: Path,
                 secrets: list[str], attempt: int = 1) -> None:
        self.rank = rank
        self.node = node
        self.local_rank = local_rank
        self.script = script
        self.secrets = secrets
        self.attempt = attempt
        self.lost: str | None = None  # a local process is never lost: it exits
        self.proc: subprocess.Popen[bytes] | None = None
        self.reader: threading.Thread | None = None
        self.exited_at: float | None = None

    def start(self, emit: Callable[[str], None]) -> int | None:
        """Run ``bash launch-<node>.sh LOCAL_RANK``; secrets go in on stdin."""
        self.proc = subprocess.Popen(
            ["bash", str(self.script), str(self.local_rank)],
            stdin=subprocess.PIPE if self.secrets else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=self.script.parent, start_new_session=True,
            env={**os.environ, ATTEMPT_VAR: str(self.attempt)},
        )
        if self.secrets and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("".join(v + "\n" for v in self.secrets).encode())
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        assert self.proc.stdout is not None
        self.reader = threading.Thread(target=_pump, args=(self.proc.stdout, emit), daemon=True)
        self.reader.start()
        return self.proc.pid

    def poll(self) -> Exit | None:
        """The exit, once the process ended and its output is drained (or 2 s passed)."""
        assert self.proc is not None and self.reader is not None
        code = self.proc.poll()
        if code is None:
            return None
        if self.exited_at is None:
            self.exited_at = time.monotonic()
        if self.reader.is_alive() and time.monotonic() - self.exited_at < 2.0:
            return None
        return Exit(signal=-code) if code < 0 else Exit(code=code)

    def stop(self, force: bool) -> None:
        """Signal the rank's whole process group."""
        if self.proc is None or self.proc.poll() is not None:
            return
        sigs = (signal.SIGKILL,) if force else (signal.SIGTERM, signal.SIGCONT)
        for sig in sigs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)


def _pump(stream: IO[bytes], emit: Callable[[str], None]) -> None:
    for raw in iter(stream.readline, b""):
        emit(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
    stream.close()


def _reap(job_id: str) -> None:
    host.reap(job_id, STOP_GRACE_S)


def run_supervisor(job_id: str, store_path: Path) -> int:
    """The supervisor process's body: run the job's ranks to the end."""
    store = Store(store_path, patience_s=SUPERVISOR_PATIENCE_S)
    job = store.get(job_id)
    if job is None:
        return 2
    stop = StopRequest()
    stop.install()
    start_watchdog(os.getpid(), job_id, STOP_GRACE_S)
    plan = job.plan
    run_dir = Path(job.run_dir)
    node = plan.nodes[0]
    script = run_dir / node_script_name(node.name)
    secrets = [os.environ.get(name, "") for name in plan.secret_env]

    def launch(attempt: int, excluded: tuple[str, ...]) -> tuple[Plan, Launched]:
        # One node, this machine, the same leased GPUs, slots and port for every attempt.
        handles = [LocalRank(r.rank, r.node, r.local_rank, script, secrets, attempt)
                   for r in plan.ranks]
        evidence = RunDirEvidence(run_dir, [r.rank for r in plan.ranks])
        return plan, Launched(handles, lambda: _reap(job_id), evidence=evidence)

    def progress(current: Plan) -> dict[str, int | None]:
        return progress_marker(str(run_dir), checkpoint_dir(current))

    try:
        outcome = run_with_restarts(job_id, run_dir, store, plan, stop, STOP_GRACE_S, launch,
                                    progress)
    finally:
        with contextlib.suppress(OSError):
            host.LeaseBook().release(job_id)
    return 0 if outcome.state == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(run_supervisor(sys.argv[1], Path(sys.argv[2])))
