"""Detached supervisors: the local and SSH backends' common shape, and the process plumbing.

Each job of these backends runs under a supervisor process of its own, started in a new session
so that it outlives the ``submit`` that started it (``--detach``, a closed terminal).
:class:`DetachedBackend` is the CLI side of their one lifecycle (written down in
:mod:`orchestrate.backends.base`): ``submit`` and ``resume`` start the supervisor with a
:class:`~orchestrate.backends.handshake.Handshake` and wait for its verdict; ``refresh`` and
``cancel`` are the same for both. A backend fills in only what really differs: which program
supervises (``supervisor_module``), what ``submit`` checks first, and how to stop the job's
processes everywhere once its supervisor is gone (``stop_everywhere``). The supervisor side is
:class:`orchestrate.backends.supervisor.Supervisor`.

The plumbing: starting a supervisor, knowing whether it still runs, and stopping it (SIGTERM,
wait until it is gone, SIGKILL as a last resort). A supervisor is identified by its pid *and* its
command line naming the job id, so a reused pid is never mistaken for it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import orchestrate.hostside.bookdir
import orchestrate.hostside.containment
import orchestrate.hostside.fairshare
import orchestrate.hostside.gpuuse
import orchestrate.hostside.host
import orchestrate.hostside.leaserecord
import orchestrate.hostside.leases
import orchestrate.hostside.smi
import orchestrate.hostside.smicsv
import orchestrate.hostside.watchdog
from orchestrate.backends.base import make_run_dir, secret_values
from orchestrate.backends.handshake import Handshake, Verdict, keep_end_signal, read_verdict
from orchestrate.core.errors import UserError
from orchestrate.core.layout import SUPERVISOR_LOG
from orchestrate.hostside.shipping import Manifest, compact, program
from orchestrate.run.store import JobRecord, Store

if TYPE_CHECKING:
    from orchestrate.backends.early import Early
    from orchestrate.core.plan.plan import Plan
    from orchestrate.run.prepare import Prepared

#: How long ``cancel`` gives a supervisor to stop its job its own way and exit, before it is
#: SIGKILLed and the job is stopped from here (:meth:`DetachedBackend.stop_everywhere`). Its way
#: is bounded, step by step: SIGTERM to every rank and STOP_GRACE_S (5 s) to checkpoint, then
#: SIGKILL and run/supervise.py's KILL_WAIT_S (5 s) for their ends; then kill-by-tag wherever
#: anything was left, with its own 5 s grace, on hosts whose connection may have to log in again
#: (ssh.connect_timeout_s, 10 s by default); then it records the end, reads the training progress
#: and writes report.html (10 s on a loaded machine). 5 + 5 + 5 + 10 + 10 = 35 s, for every
#: backend: a healthy local supervisor needs a few seconds of it, and only a stuck one waits out
#: the rest (the local and SSH backends had 15 s and 35 s; the shorter one was too short for a
#: sweep that must log in again).
CANCEL_GRACE_S = 35.0
#: Longest ``submit`` waits for the supervisor's verdict (its own steps all have deadlines).
VERDICT_TIMEOUT_S = 900.0


class DetachedBackend(ABC):
    """The CLI side of a backend whose jobs run under a detached supervisor (local, SSH).

    ``files`` and ``check`` are the backend's own (the :class:`~orchestrate.backends.base.Backend`
    protocol); the rest of the protocol is here, once.
    """

    name: str
    #: The store is written by the supervisor on this machine: it can be asked often.
    poll_interval_s: float = 0.2
    #: The supervisor program, run as ``python -m MODULE JOB_ID STORE_PATH``.
    supervisor_module: ClassVar[str]
    #: How messages name this backend ("the SSH supervisor ...").
    label: ClassVar[str]

    # ---- what differs ----------------------------------------------------------------------

    @abstractmethod
    def files(self, plan: Plan, templates_dir: Path | None) -> dict[str, str]:
        """Every file the job's run directory gets (see the Backend protocol)."""

    @abstractmethod
    def check(self, prepared: Prepared) -> None:
        """``submit --dry-run`` (see the Backend protocol)."""

    @abstractmethod
    def stop_everywhere(self, job: JobRecord) -> dict[str, str]:
        """Stop whatever the job left running, wherever it ran, and release what it held, with
        no supervisor to do it (it vanished, or did not stop in time); failure reasons by
        host."""

    def check_submit(self, prepared: Prepared) -> None:
        """What ``submit`` (not ``resume``) refuses before starting anything; nothing here."""
        return None  # nothing by default

    def handshake(self, prepared: Prepared, attempt: int | None) -> Handshake:
        """What the supervisor is handed (a backend may add to it); with what its claim reads
        of the job, so that it can launch before it decodes the job (the spec models)."""
        from orchestrate.backends.sharing import claim_facts

        return Handshake(job_id=prepared.plan.job_id, source=str(prepared.path),
                         submitted_at=time.time(), attempt=attempt, plan=prepared.plan,
                         loaded=prepared.loaded.to_json(), facts=claim_facts(prepared))

    # ---- the lifecycle, CLI side -----------------------------------------------------------

    def submit(self, prepared: Prepared, store: Store, early: Early | None = None
               ) -> JobRecord:
        """Start the supervisor (or hand the job to the one ``submit`` started before planning:
        :mod:`orchestrate.backends.early`); return once it launched the job, or raise what it
        refused."""
        self.check_submit(prepared)
        return self._start(prepared, store, None, early)

    def resume(self, job: JobRecord, prepared: Prepared, store: Store) -> JobRecord:
        """The next attempt of an ended job, through a new supervisor (claims as at submit)."""
        return self._start(prepared, store, job.attempt + 1)

    def _start(self, prepared: Prepared, store: Store, attempt: int | None,
               early: Early | None = None) -> JobRecord:
        plan = prepared.plan
        secret_values(plan.secret_env, str(prepared.path))
        run_dir = make_run_dir(prepared)  # for the supervisor's log; it writes the rest
        handshake = self.handshake(prepared, attempt)
        proc = _taken(early, self.supervisor_module, plan.job_id, store, run_dir) \
            or start(self.supervisor_module, plan.job_id, store, run_dir)
        verdict = _exchange(proc, handshake)
        if verdict is None:
            if proc.poll() is None:
                proc.terminate()
            raise UserError.single(
                f"the {self.label} supervisor ended before launching the job",
                source=str(prepared.path), hint=f"its log: {run_dir / SUPERVISOR_LOG}")
        if not verdict.ok:
            if attempt is None:
                _discard(run_dir, proc)
            if verdict.table is not None:
                verdict.table.print(only_failed=True)
            raise UserError(verdict.problems)
        record = store.get(plan.job_id)
        assert record is not None  # the supervisor recorded it before its verdict
        return record

    def refresh(self, job: JobRecord, store: Store) -> JobRecord:
        """A running job whose supervisor (on this machine) is gone has failed: stop what it
        may have left and say so."""
        if job.terminal or job.supervisor_pid is None or not on_this_machine(job):
            return job
        if alive(job.supervisor_pid, job.id):
            return job
        failed = self.stop_everywhere(job)
        store.finish(job.id, "FAILED", "the job's supervisor process vanished" + unreached(failed))
        return store.get(job.id) or job

    def cancel(self, job: JobRecord, store: Store) -> JobRecord:
        """SIGTERM the supervisor (it stops every rank its way); when it cannot (gone, stuck),
        stop everything from here."""
        if job.terminal:
            return job
        reason = "cancelled"
        if not stop(job, store, CANCEL_GRACE_S):
            reason += unreached(self.stop_everywhere(job))
        store.finish(job.id, "CANCELLED", reason)
        return store.get(job.id) or job


def _taken(early: Early | None, module: str, job_id: str, store: Store, run_dir: Path
           ) -> subprocess.Popen[bytes] | None:
    """The supervisor started before planning, now running ``module`` for the job; None
    without one, or when it cannot (it ended)."""
    if early is None:
        return None
    from orchestrate.backends.early import Go

    return early.take(Go(module, job_id, str(store.path), str(run_dir / SUPERVISOR_LOG)))


def _exchange(proc: subprocess.Popen[bytes], handshake: Handshake) -> Verdict | None:
    """Hand the supervisor its job and wait for its verdict; a Ctrl-C meanwhile stops it
    (it aborts, launching nothing)."""
    assert proc.stdin is not None and proc.stdout is not None
    verdict = None
    try:
        proc.stdin.write((json.dumps(handshake.to_json()) + "\n").encode())
        proc.stdin.close()
        verdict = read_verdict(proc.stdout, VERDICT_TIMEOUT_S)
        return verdict
    except BaseException:
        proc.terminate()
        raise
    finally:
        if verdict is not None and verdict.ok:  # its end of file: the job's end is recorded
            keep_end_signal(handshake.job_id, proc.stdout)
        else:
            proc.stdout.close()


def _discard(run_dir: Path, proc: subprocess.Popen[bytes]) -> None:
    """A refused submit leaves no run dir behind (nothing ran; the refusal is printed), so
    ``ls runs/`` shows jobs, not attempts to place them. Only a dir holding nothing but the
    supervisor's log is removed: anything else there was not made by this submit."""
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return
    if {p.name for p in run_dir.iterdir()} <= {SUPERVISOR_LOG}:
        shutil.rmtree(run_dir, ignore_errors=True)


def unreached(failed: Mapping[str, str]) -> str:
    """The end of a reason naming the hosts that could not be stopped, if any."""
    if not failed:
        return ""
    return "; could not reach " + ", ".join(f"{h} ({why})" for h, why in failed.items())


def start(module: str, job_id: str, store: Store, run_dir: Path) -> subprocess.Popen[bytes]:
    """Start ``python -m MODULE JOB_ID STORE_PATH`` in its own session, in this directory (so
    relative paths agree), its stdin and stdout pipes to this process (the handshake and the
    verdict), its stderr the run dir's supervisor log."""
    with open(run_dir / SUPERVISOR_LOG, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", module, job_id, str(store.path)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=log, start_new_session=True,
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
    from orchestrate.backends.early import names

    # The id, or the pattern of a supervisor started before its job was planned.
    return any(names(word, job_id.encode()) for word in cmdline.split(b"\0"))


def on_this_machine(job: JobRecord) -> bool:
    """Whether the job's supervisor runs (or ran) on this machine."""
    import socket

    return job.supervisor_host in (None, socket.gethostname())


def stop(job: JobRecord, store: Store, wait_s: float) -> bool:
    """SIGTERM the job's supervisor and wait up to ``wait_s`` for it to end the job and exit;
    SIGKILL it if it does not. True when it ended the job itself (its ranks stopped its way, its
    leases released as it exited)."""
    pid = job.supervisor_pid
    if pid is None or not on_this_machine(job) or not alive(pid, job.id):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and alive(pid, job.id):
        time.sleep(0.05)
    if alive(pid, job.id):
        os.kill(pid, signal.SIGKILL)
        return False
    current = store.get(job.id)
    return current is not None and current.terminal


#: The local supervisor's watchdog: kill-by-tag, containment, and the lease book it leaves.
WATCHDOG = Manifest("watchdog", (
    orchestrate.hostside.host, orchestrate.hostside.containment, orchestrate.hostside.smicsv,
    orchestrate.hostside.smi, orchestrate.hostside.gpuuse, orchestrate.hostside.bookdir,
    orchestrate.hostside.leaserecord, orchestrate.hostside.fairshare, orchestrate.hostside.leases,
    orchestrate.hostside.watchdog))


@lru_cache(maxsize=1)
def watchdog_modules() -> str:
    """The watchdog's modules as a compacted program that makes them importable (its call
    follows, per job): whole, the book's modules outgrow a quarter of one argument's limit.
    Compressed once per process (20-30 ms), by a supervisor started before planning while it
    waits (:mod:`orchestrate.backends.early`)."""
    return compact(program(WATCHDOG, ""))


#: The watchdog's first argument (then the job id): what ``ps`` shows of it.
WATCHDOG_NAME = "orchestrate-watchdog"


def start_watchdog(pid: int, job_id: str, grace_s: float,
                   lease_root: str | None = None, containers: bool = True
                   ) -> subprocess.Popen[bytes]:
    """A tiny process that outlives ``pid`` (a supervisor) by at most a grace period: when it
    ends, however it ends, the watchdog stops whatever the job left on this machine (its
    containers too, unless ``containers`` is False: the job runs in none) and leaves its lease
    (:func:`orchestrate.hostside.watchdog.watch`). Standard library only, no site-packages."""
    from orchestrate.hostside.host import TAG, proc_start

    text = watchdog_modules() + (
        "from orchestrate.hostside.watchdog import watch\n"
        f"watch({pid}, {proc_start(pid)!r}, {job_id!r}, {grace_s!r}, "
        f"lease_root={lease_root!r}, containers={containers!r})\n")
    # Untagged, or it would count as a process of the job and keep the job's lease alive.
    env = {k: v for k, v in os.environ.items() if k != TAG}
    return subprocess.Popen(
        # Named on its command line (the program itself is a compacted blob): ``ps`` shows
        # whose watchdog it is.
        [sys.executable, "-S", "-c", text, WATCHDOG_NAME, job_id], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env,
    )
