"""The supervisor side of a detached backend's lifecycle (see :mod:`orchestrate.backends.base`).

A detached supervisor (``python -m orchestrate.backends.local.supervisor JOB STORE``, or the SSH
one) reads its :class:`~orchestrate.backends.handshake.Handshake`, then, in this order and
nowhere else: claims what the job needs, writes the run directory, records the job, answers
``submit`` (the :class:`~orchestrate.backends.handshake.Verdict`), and runs the attempts with
the shared loop of :mod:`orchestrate.run.supervise`. :class:`Supervisor` is that sequence, in
the manner of torch elastic's ``SimpleElasticAgent``: a backend's supervisor fills in what
really differs -- :meth:`~Supervisor.claim` (leases, a re-plan), :meth:`~Supervisor.ship` (files
onto other machines), :meth:`~Supervisor.start_workers` (the rank handles of an attempt),
:meth:`~Supervisor.progress`, and what to release when nothing runs (:meth:`~Supervisor.abort`)
or everything ended (:meth:`~Supervisor.end`).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from abc import ABC, abstractmethod
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from orchestrate.backends.base import STOP_GRACE_S, new_record, write_run_dir
from orchestrate.backends.handshake import Handshake, Verdict, VerdictLine
from orchestrate.core.errors import EXIT_BUSY, Problem, UserError
from orchestrate.core.layout import FOREIGN_GPU_USE, SUPERVISOR_LOG
from orchestrate.core.plan.outcome import Attempt
from orchestrate.run.jobrecord import JobState
from orchestrate.run.progress import reporting, show
from orchestrate.run.store import PATIENCE_S, SUPERVISOR_PATIENCE_S, Store

if TYPE_CHECKING:
    from orchestrate.backends.detached import DetachedBackend
    from orchestrate.backends.sharing import ForeignWatch
    from orchestrate.core.plan.plan import Plan
    from orchestrate.run.loaded import Prepared
    from orchestrate.run.supervise import Launched, StopRequest


class WaitEnded(Exception):
    """A waiting job ends before it started: ``state`` (CANCELLED, DEADLINE) and why."""

    def __init__(self, state: JobState, reason: str) -> None:
        super().__init__(reason)
        self.state: JobState = state


class Supervisor(ABC):
    """One job's supervisor process, from the handshake to the job's end."""

    #: The backend (its ``files`` and ``label``).
    backend: ClassVar[DetachedBackend]
    #: How often a waiting job looks again at what it waits for (its book, its hosts).
    wait_poll_s: ClassVar[float] = 0.25
    #: What ``submit`` writes on stdin (a backend's may carry more).
    handshake_type: ClassVar[type[Handshake]] = Handshake

    def __init__(self, job_id: str, store_path: Path) -> None:
        from orchestrate.run.supervise import StopRequest

        self.job_id = job_id
        self.store_path = store_path
        self.started = time.monotonic()
        #: How long the launch steps took: sent in the verdict, and logged.
        self.timings: dict[str, float] = {}
        # The job's state, in the order this process comes to know it.
        #: What ``submit`` wrote on stdin: the job loaded and planned, the attempt to run.
        self.handshake: Handshake = self._read_handshake()
        #: The first attempt this process runs (``resume``'s next one, else 1).
        self.first: int = self.handshake.attempt or 1
        #: A cancel or a stop signal, once asked for (its handlers installed by :meth:`main`).
        self.stop: StopRequest = StopRequest()
        #: What the job waits for (``resources.wait``) once it waits; None until then.
        self.pending: str | None = None
        # Opened and decoded by :meth:`main` (what fails there refuses the submit): the
        # properties :attr:`store` and :attr:`submitted`.
        self._store: Store | None = None
        self._submitted: Prepared | None = None
        #: The attempt made ready last: the one that runs (None before the first is).
        self.prepared: Prepared | None = None

    @property
    def store(self) -> Store:
        """The job store (the CLI's patience until the verdict, then the supervisor's)."""
        assert self._store is not None, "main() opens the store first"
        return self._store

    @property
    def submitted(self) -> Prepared:
        """The job as ``submit`` loaded and planned it."""
        assert self._submitted is not None, "main() decodes the job first"
        return self._submitted

    # ---- what differs ----------------------------------------------------------------------

    def begin(self, handshake: Handshake) -> None:
        """First thing, before the handshake's job is decoded (SSH: start logging in)."""
        return None  # nothing by default

    @abstractmethod
    def claim(self, attempt: int, excluded: tuple[str, ...]) -> Prepared | None:
        """Claim what ``attempt`` needs, re-planning around what others hold (and without the
        ``excluded`` nodes); the plan to launch, or None to run where the last attempt ran
        (nothing claimed again, nothing written again). Raises what refuses the job."""

    def ship(self, prepared: Prepared, files: dict[str, str]) -> None:
        """Put the attempt's files where its ranks run, before the run directory is written
        here (nothing to do when they run on this machine)."""
        return None  # nothing by default

    def hostnames(self) -> dict[str, str]:
        """What each node calls itself, for the store's rank rows (none known here)."""
        return {}

    @abstractmethod
    def start_workers(self, prepared: Prepared, attempt: int) -> Launched:
        """The attempt's ranks, ready to start (the handles, their cleanup, the evidence)."""

    @abstractmethod
    def progress(self, plan: Plan) -> dict[str, int | None]:
        """How far training got (for the restart policy: :class:`orchestrate.run.supervise
        .Attempts`)."""

    def refusal(self, exc: BaseException) -> Verdict | None:
        """The verdict for a backend's own way of refusing (None: the usual one)."""
        return None

    def abort(self) -> None:
        """Nothing will run: release what was claimed."""
        return None  # nothing by default

    def end(self) -> None:
        """The job ended: release what it held."""
        return None  # nothing by default

    # ---- the sequence ----------------------------------------------------------------------

    def main(self) -> int:
        """The supervisor process's body; its exit status (0: the job completed)."""
        from orchestrate.run.supervise import run_with_restarts

        verdict = VerdictLine()
        try:
            self.begin(self.handshake)
            self.stop.install()
            # Until its verdict it writes for a CLI that waits: a store locked for longer than
            # the CLI's patience refuses the submit, as it would refuse any command.
            self._store = Store(self.store_path, patience_s=PATIENCE_S)
            from orchestrate.run.loaded import Prepared

            # Decoded when first needed: a local job claimed with the CLI's facts and launched
            # as planned never imports the spec models here (orchestrate/run/loaded.py).
            self._submitted = Prepared(self.handshake.loaded, self.handshake.plan,
                                       self.handshake.facts)
            with reporting(verdict.progress):  # the phases, for submit's progress line
                prepared = self._first_attempt(verdict)
            self.prepared = prepared
        except BaseException as exc:
            if self.pending is not None:
                return self._give_up(exc)
            return self._refuse(exc, verdict)
        self.log(f"launching {prepared.plan.world_size} rank(s) on {len(prepared.plan.nodes)} "
                 f"node(s) after {time.monotonic() - self.started:.2f}s ({self.timings})")
        verdict.send(Verdict(ok=True, timings=self.timings))
        self.store.patience_s = SUPERVISOR_PATIENCE_S  # from now on, the job's fate is recorded
        try:
            outcome = run_with_restarts(self.job_id, self.run_dir, self.store, prepared.plan,
                                        self.stop, STOP_GRACE_S, self)
            verdict.ended()  # the end and the report are written: a following submit ends
        finally:
            self.end()
        return 0 if outcome.state == "COMPLETED" else 1

    def _first_attempt(self, verdict: VerdictLine) -> Prepared:
        """Claim and ready the first attempt; a job that waits (``resources.wait``) and finds
        what it needs held is recorded PENDING, answered, and tries again until it gets it, is
        cancelled or runs out of time (:class:`WaitEnded`)."""
        from orchestrate.backends.sharing import wait_limit, waiting_reason

        limit = wait_limit(self.submitted)
        deadline = time.monotonic() + (limit or 0.0)
        while True:
            try:
                prepared = self._prepare(self.first, ())
                assert prepared is not None, "the first attempt always claims"
                return prepared
            except UserError as exc:
                if limit is None or exc.exit_status != EXIT_BUSY:
                    raise
                reason = waiting_reason(exc)
            if self.pending is None:
                self._record_pending(reason)
                verdict.send(Verdict(ok=True, pending=reason))
            elif reason != self.pending:
                self.store.update(self.job_id, reason=reason)
            self.pending = reason
            self.store.patience_s = SUPERVISOR_PATIENCE_S
            until = min(time.monotonic() + self.wait_poll_s, deadline)
            while time.monotonic() < until and not self.stop.reason:
                time.sleep(0.02)
            if self.stop.reason:
                raise WaitEnded("CANCELLED", f"withdrawn while waiting: {self.stop.reason}")
            if time.monotonic() >= deadline:
                raise WaitEnded("DEADLINE", f"not placed within {limit:g}s (resources.wait); "
                                f"it was {reason}")

    def _record_pending(self, reason: str) -> None:
        """The waiting job in the store, so that ``status``, ``list`` and ``cancel`` see it."""
        record = new_record(self.submitted, "PENDING", self.handshake.submitted_at)
        record.reason = reason
        record.supervisor_pid, record.supervisor_host = os.getpid(), socket.gethostname()
        if self.handshake.attempt is None:
            self.store.add(record)
        else:
            self.store.reopen(self.job_id, Attempt(self.first, self.handshake.submitted_at))
            self.store.update(self.job_id, reason=reason, supervisor_pid=os.getpid(),
                              supervisor_host=socket.gethostname(),
                              lease_books=record.lease_books)

    def _give_up(self, exc: BaseException) -> int:
        """A waiting job that will not run after all: cancelled, out of time, or refused for
        good meanwhile. It was recorded: its end is too."""
        self.abort()
        if isinstance(exc, WaitEnded):
            state, reason = exc.state, str(exc)
        elif isinstance(exc, UserError):
            state = "FAILED"
            reason = "; ".join(p.message for p in exc.problems)
        else:
            self.log("".join(traceback.format_exception(exc)))
            state, reason = "FAILED", f"{type(exc).__name__}: {exc}"
        self.log(f"job {self.job_id} {state} before it started: {reason}")
        self.store.finish(self.job_id, state, reason)
        return 1

    @property
    def run_dir(self) -> Path:
        """The job's run directory."""
        return Path(self.handshake.plan.run_dir)

    @cached_property
    def foreign(self) -> ForeignWatch:
        """Other users' processes on the job's GPUs, as the backend's watchers report them
        (logged, listed for ``status``, named in the attempt's ending)."""
        from orchestrate.backends.sharing import ForeignWatch

        return ForeignWatch(self.run_dir / FOREIGN_GPU_USE, self.log)

    def _read_handshake(self) -> Handshake:
        return self.handshake_type.from_json(json.loads(sys.stdin.readline()))

    def _prepare(self, attempt: int, excluded: tuple[str, ...]) -> Prepared | None:
        """Claim, write the run directory, record: an attempt made ready to start."""
        show("claiming what the plan needs")
        prepared = self.claim(attempt, excluded)
        if prepared is None:
            return None
        files = self.backend.files(prepared.plan, prepared.templates_dir)
        show("copying the job's files")
        self.ship(prepared, files)
        write_run_dir(prepared, files)
        self._record(prepared, attempt)
        return prepared

    def launch(self, attempt: int, excluded: tuple[str, ...]) -> tuple[Plan, Launched]:
        """An attempt's ranks (the first one was made ready before the verdict), for
        :class:`orchestrate.run.supervise.Attempts`. A restart that cannot be made ready
        releases what it claimed (the job then ends, saying why)."""
        if attempt != self.first:
            try:
                self.prepared = self._prepare(attempt, excluded) or self.prepared
            except BaseException:
                self.abort()
                raise
        assert self.prepared is not None, "main() made the first attempt ready"
        return self.prepared.plan, self.start_workers(self.prepared, attempt)

    def _record(self, prepared: Prepared, attempt: int) -> None:
        """The job in the store: a new record, ``resume``'s next attempt of the old one, or a
        restart's new plan (the restart policy reopened the attempt already)."""
        from orchestrate.backends.sharing import lease_books

        plan, names = prepared.plan, self.hostnames()
        pid, here = os.getpid(), socket.gethostname()
        books = lease_books(prepared)  # a restart on other nodes leases in their books
        if attempt == self.first and self.pending is not None:  # recorded while it waited
            self.store.update(self.job_id, plan=plan, hosts=[n.address for n in plan.nodes],
                              reason="", lease_books=books)
            for r in plan.ranks:
                self.store.update_rank(self.job_id, r.rank, node=r.node, host=names.get(r.node))
            return
        if attempt == self.first and self.handshake.attempt is None:
            record = new_record(prepared, "PENDING", self.handshake.submitted_at)
            record.supervisor_pid, record.supervisor_host = pid, here
            for rank in record.ranks:
                rank.host = names.get(rank.node)
            self.store.add(record)
            return
        hosts = [n.address for n in plan.nodes]
        if attempt == self.first:
            self.store.reopen(self.job_id, Attempt(attempt, self.handshake.submitted_at))
            self.store.update(self.job_id, plan=plan, hosts=hosts, supervisor_pid=pid,
                              supervisor_host=here, lease_books=books)
        else:
            self.store.update(self.job_id, plan=plan, hosts=hosts, lease_books=books)
        for r in plan.ranks:  # a rank may have moved (a node excluded)
            self.store.update_rank(self.job_id, r.rank, node=r.node, host=names.get(r.node))

    def _refuse(self, exc: BaseException, verdict: VerdictLine) -> int:
        """Nothing launched: release the claims and tell ``submit`` why (exit 2, or 1 for
        what is no user's mistake)."""
        answer, status = self.refusal(exc), 2
        if answer is None and isinstance(exc, UserError):
            answer = Verdict(ok=False, problems=exc.problems)
        if answer is None:
            self.log("".join(traceback.format_exception(exc)))
            answer, status = Verdict(ok=False, problems=(Problem(
                f"the {self.backend.label} launch failed: {type(exc).__name__}: {exc}",
                source=self.handshake.source,
                hint=f"details in {self.run_dir / SUPERVISOR_LOG}"),)), 1
        self.abort()
        verdict.send(answer)
        return status

    def log(self, text: str) -> None:
        """A line in the supervisor's log, stamped."""
        print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)
