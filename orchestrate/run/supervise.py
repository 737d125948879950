"""The supervisor: the one process that watches every rank of a running job.

It starts the ranks (through a backend's :class:`RankHandle`), copies their output into the
log sink, records each exit in the store, and ends the job the moment it cannot succeed, naming
why, instead of leaving ranks to wait in a collective for torch's timeout:

- the first rank that fails (:func:`orchestrate.core.plan.outcome.first_failure`) is named with
  its node, exit status and last log lines, and every other rank is stopped (FAILED); when it
  died saying nothing, up to :data:`BLAME_SETTLE_S` for a rank that explains it
  (:func:`~orchestrate.core.plan.outcome.settled`);
- a cancel (SIGTERM/SIGINT/SIGHUP to the supervisor) stops every rank (CANCELLED);
- the job's time limit (``resources.time``), enforced as Slurm does: SIGTERM to every rank, a
  grace period, SIGKILL (TIMEOUT);
- rank 0 finished while other ranks still run, or every running rank hangs in its exit
  (:mod:`.linger`): stopped ``distributed.timeout_s`` + 30 s later (FAILED);
- the run directory cannot take the ranks' output (its file system is full): the ranks are
  stopped rather than left blocked on a full pipe (FAILED, "cannot write logs");
- no rank made progress for ``distributed.stall_s`` (the stall watch,
  :mod:`orchestrate.diagnosis.hangwatch`, in a thread beside this loop): the stuck rank is named in
  the log, the store (``status``' diagnosis) and ``diag/diagnosis.json``; with ``on_stall: kill``
  every rank is stopped (FAILED, an ending ``restart.on: [stall]`` restarts); ranks hung in
  their exit (kind ``teardown``) are stopped under ``on_stall: report`` too, later (:mod:`.linger`);
- a process formed a process group that is not the plan's world (the world check,
  :mod:`orchestrate.diagnosis.world`, in the same thread, and once more at the end): named as
  a ``wrong_world`` diagnosis; ``on_wrong_world: kill`` (the default) stops the job, FAILED.

The loop looks every :data:`POLL_S`, and at once when a rank's process exits (where a handle
can say so: :meth:`RankHandle.exit_fd`, a local process's pidfd).

Ranks the job stops itself are STOPPED, never FAILED; the workers of ``per_node``/``torchrun``
follow their node's process (:mod:`.workerranks`). Local and SSH jobs share this loop.
"""

from __future__ import annotations

import contextlib
import functools
import select
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from orchestrate.core.layout import MERGED_INDEX, METRICS, rank_log
from orchestrate.core.plan.outcome import Attempt, Exit, Failure, RankEnd, settled
from orchestrate.core.plan.plan import Plan
from orchestrate.core.plan.restart import Ending, decide, ending_of, progressed
from orchestrate.core.plan.workers import REPORT_LINES, worker_end
from orchestrate.diagnosis.hangwatch import Evidence
from orchestrate.diagnosis.stall import Diagnosis
from orchestrate.diagnosis.world import KIND as WRONG_WORLD
from orchestrate.hostside.outputlog import append_note
from orchestrate.run import workerranks
from orchestrate.run.attemptmetrics import record_first_step, resumed_from
from orchestrate.run.jobrecord import RESTARTING, STOPPED, JobState, RankState
from orchestrate.run.knobs import seconds
from orchestrate.run.linger import Linger, linger_s
from orchestrate.run.logsink import LogSink, last_lines
from orchestrate.run.store import Store
from orchestrate.run.watcher import watch_attempt

POLL_S = 0.05
#: How long a failure that nobody explained yet waits for a rank that explains it.
BLAME_SETTLE_S = seconds("ORCHESTRATE_BLAME_SETTLE_S", 3.0)
#: After SIGKILL, how long to wait for a rank's end before giving up on it.
KILL_WAIT_S = 5.0


class RankHandle(Protocol):
    """One rank, however it is run (a local process, an SSH channel)."""

    rank: int
    node: str
    #: Set when the rank's host was lost (no word from it within its deadline): why, and when.
    lost: str | None

    def start(self, emit: Callable[[bytes], None]) -> int | None:
        """Start the rank; ``emit`` gets its output as it comes: a line with its newline, or
        LINE_MAX bytes of a longer one (hostside/outputlog.py). Returns its pid if known."""

    def poll(self) -> Exit | None:
        """The exit, once the rank has ended."""

    def stop(self, force: bool) -> None:
        """Ask the rank to stop (SIGTERM), or make it (SIGKILL) when ``force``."""

    def exit_fd(self) -> int | None:
        """Readable once the rank's process exits (a pidfd); None: none (a remote rank)."""


class StopRequest:
    """Set by signal handlers: the job is being cancelled."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def install(self) -> None:
        """Turn SIGTERM, SIGINT and SIGHUP into a cancel request."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        self.reason = f"cancelled ({signal.Signals(signum).name} to the supervisor)"


@dataclass
class Outcome:
    """How the job (or one attempt of it) ended."""

    state: JobState
    reason: str
    failure: Failure | None
    failed_exits: list[Exit] = field(default_factory=list)  # every rank's non-zero exit
    lost_node: str | None = None
    stalled: bool = False

    def ending(self) -> Ending:
        """The ending as the restart policy sees it."""
        if self.state == "COMPLETED":
            return Ending("completed", self.reason)
        if self.state in ("CANCELLED", "TIMEOUT"):
            return Ending(self.state.lower(), self.reason)
        first = self.failure.exit if self.failure is not None else None
        node = self.lost_node or (self.failure.node if self.failure is not None else None)
        return ending_of(self.failed_exits, first, node, self.reason, self.stalled,
                         self.lost_node is not None)


class _Run:
    """One supervised run of the job's ranks: what happened so far, and the rules above."""

    def __init__(self, job_id: str, run_dir: Path, store: Store, plan: Plan,
                 handles: Sequence[RankHandle], sink: LogSink, grace_s: float) -> None:
        self.job_id = job_id
        self.run_dir = run_dir
        self.store = store
        self.sink = sink
        self.grace_s = grace_s
        self.handles = list(handles)
        self.running: dict[int, RankHandle] = {h.rank: h for h in handles}
        self.exits: dict[int, Exit] = {}
        self.ends: list[RankEnd] = []  # every end of this run, as blamed (a launcher's worker)
        self.failure: Failure | None = None
        self.ending: Outcome | None = None  # why the job is being stopped, once it is
        self.stop_deadline: float | None = None
        self.limit_at: float | None = None
        if plan.time_limit:  # the spec module (pydantic) only where a limit is set: start-up
            from orchestrate.core.spec.job import time_limit_seconds

            self.limit_s = time_limit_seconds(plan.time_limit)
            self.limit_at = time.monotonic() + self.limit_s
        self.linger = Linger(linger_s(plan.timeout_s))
        self.per_node = plan.per_node
        self.logged_as: dict[int, int] = {}  # a failed worker's rank -> its launcher's handle
        self.nodes = workerranks.node_ranks(plan, [h.rank for h in handles])

    def _end_of(self, end: RankEnd) -> RankEnd:
        """A handle's end; under a launcher that starts workers, the end of the worker that its
        launcher's last lines name as failed (:func:`~orchestrate.core.plan.workers.worker_end`),
        so the failure names that worker, with the launcher's log."""
        if not self.per_node or end.exit.ok:
            return end
        worker = worker_end(end, last_lines(rank_log(self.run_dir, end.rank), REPORT_LINES))
        self.logged_as[worker.rank] = end.rank
        return worker

    def pause(self, seconds: float) -> None:
        """Until the next look: ``seconds``, or less when a running rank's process exits."""
        fds = [fd for fd in (h.exit_fd() for h in self.running.values()) if fd is not None]
        try:
            select.select(fds, [], [], seconds) if fds else time.sleep(seconds)
        except (OSError, ValueError):  # a descriptor closed meanwhile
            time.sleep(seconds)

    # ---- events --------------------------------------------------------------------------

    def collect(self) -> None:
        """Record the ranks that ended since the last call; apply the failure rule."""
        ended: list[RankEnd] = []
        for rank, handle in list(self.running.items()):
            result = handle.poll()
            if result is None:
                continue
            del self.running[rank]
            self.exits[rank] = result
            now = time.time()
            ended.append(self._end_of(RankEnd(rank, handle.node, result, now)))
            stopped_by_us = self.ending is not None
            ended_as: RankState = "COMPLETED" if result.ok else (
                STOPPED if stopped_by_us else "FAILED")
            self.store.update_rank(self.job_id, rank, state=ended_as, exit_code=result.code,
                                   signal=result.signal, finished_at=now)
            workerranks.ended(self.store, self.job_id, self.nodes.get(rank, ()), ended[-1],
                              ended_as, now)
            if result.ok:
                self.linger.exited(rank, handle.node, time.monotonic())
        self.ends.extend(ended)
        if self.ending is not None or all(end.exit.ok for end in self.ends):
            return
        self.sink.flush()  # the ranks' last lines, read to blame one
        first = settled(self.ends, self._said, bool(self.running), time.time(), BLAME_SETTLE_S)
        if first is not None:
            logged = self.logged_as.get(first.rank, first.rank)
            lost = next((h.lost for h in self.handles if h.rank == logged and h.lost), None)
            self.failure = Failure.of(first, self._said(first.rank), lost)
            reason = self.failure.sentence()
            if self.failure.requeue:
                reason += (" (it checkpointed and asks to be started again: "
                           f"`orchestrate resume {self.job_id}`)")
            self.stop_all(Outcome("NODE_FAIL" if lost else "FAILED", reason, self.failure,
                                  lost_node=first.node if lost else None),
                          f"{self.failure.sentence()}; stopping the other "
                          f"{len(self.running)} rank(s)")

    def _said(self, rank: int) -> list[str]:
        """A rank's last log lines (a launcher's worker: its launcher's)."""
        return last_lines(rank_log(self.run_dir, self.logged_as.get(rank, rank)), 10)

    def check_rules(self, cancel: str | None) -> None:
        """Cancel, time limit, lingering ranks, a log that cannot be written."""
        if self.ending is not None or not self.running:
            return
        now = time.monotonic()
        if cancel:
            self.stop_all(Outcome("CANCELLED", cancel, None),
                          f"{cancel}; stopping {len(self.running)} rank(s)")
        elif self.sink.error is not None:
            reason = f"cannot write logs: {self.sink.error}"
            self.stop_all(Outcome("FAILED", reason, None), f"{reason}; stopping every rank")
        elif self.limit_at is not None and now >= self.limit_at:
            reason = (f"time limit ({self.limit_s}s, resources.time) reached; the ranks got "
                      f"SIGTERM and {self.grace_s:.0f}s to checkpoint")
            self.stop_all(Outcome("TIMEOUT", reason, None), reason)
        else:
            self._linger(now)

    def _linger(self, now: float) -> None:
        others = sorted(self.running)
        notice = self.linger.notice(now, others)
        if notice is not None:
            self.sink.note(notice)
            self.store.update(self.job_id, reason=notice)
        due = self.linger.overdue(now, others)
        if due is not None:
            self.stop_all(Outcome("FAILED", due.reason, None, stalled=due.hung),
                          f"{due.reason}; stopping them")

    def stop_all(self, ending: Outcome, note: str) -> None:
        """Start stopping every running rank (SIGTERM now, SIGKILL after the grace period)."""
        self.ending = ending
        self.sink.note(note)
        for handle in list(self.running.values()):
            handle.stop(force=False)
        self.stop_deadline = time.monotonic() + self.grace_s

    def enforce(self) -> None:
        """SIGKILL whatever outlived its grace period."""
        if self.stop_deadline is not None and time.monotonic() > self.stop_deadline:
            for handle in self.running.values():
                handle.stop(force=True)
            self.stop_deadline = time.monotonic() + KILL_WAIT_S

    def outcome(self) -> Outcome:
        outcome = self.ending or (
            Outcome("COMPLETED", "", None) if all(e.ok for e in self.exits.values())
            else Outcome("FAILED", "a rank failed", None))
        outcome.failed_exits = [e for e in self.exits.values() if not e.ok]
        return outcome


def _stalled(run: _Run, plan: Plan, diagnosis: Diagnosis) -> None:
    """A stall or a wrong world was named: say so everywhere; with ``on_stall: kill`` (a
    stall) or ``on_wrong_world: kill`` (the default: a world that is not the plan's never ends
    COMPLETED) stop the job; under ``report``, ranks hung in their exit get the linger bound."""
    run.store.update(run.job_id, diagnosis=diagnosis.to_json())
    if run.ending is not None:
        return
    if diagnosis.kind == WRONG_WORLD:
        _wrong_world(run, plan, diagnosis)
        return
    if plan.on_stall == "kill":
        reason = f"stalled: {diagnosis.summary}"
        run.stop_all(Outcome("FAILED", reason, None, stalled=True),
                     f"{reason}; stopping every rank (distributed.on_stall: kill)")
        return
    then = run.linger.named(diagnosis.kind, time.monotonic()) or (
        f"distributed.on_stall: report: the job goes on; `orchestrate diagnose {run.job_id}` "
        "shows every rank")
    run.sink.note(f"stalled: {diagnosis.summary} ({then})")
    run.store.update(run.job_id, reason=f"stalled: {diagnosis.summary}")


def _wrong_world(run: _Run, plan: Plan, diagnosis: Diagnosis) -> None:
    """A process joined a world that is not the plan's (:mod:`orchestrate.diagnosis.world`)."""
    reason = f"wrong world: {diagnosis.summary}"
    if plan.on_wrong_world == "kill":
        run.stop_all(Outcome("FAILED", reason, None),
                     f"{reason}; stopping every rank (distributed.on_wrong_world: kill)")
        return
    run.sink.note(f"{reason} (distributed.on_wrong_world: report: the job goes on)")
    run.store.update(run.job_id, reason=reason)


def supervise(job_id: str, run_dir: Path, store: Store, handles: Sequence[RankHandle],
              stop: StopRequest, grace_s: float, plan: Plan,
              cleanup: Callable[[], str | None] | None = None, sink: LogSink | None = None,
              evidence: Evidence | None = None) -> Outcome:
    """Run one attempt's ranks to the end and return how it ended (recording each rank, not
    the job's end: :func:`run_with_restarts` decides whether it ends). ``sink`` is the job's log
    (made here unless the caller made it to write notes of its own); it is closed at the end.
    ``evidence`` is where the stall watch reads the ranks' heartbeats (None: no watch)."""
    sink = sink or LogSink(run_dir, {h.rank: h.node for h in handles}, plan.log_cap_bytes)
    run = _Run(job_id, run_dir, store, plan, handles, sink, grace_s)
    metrics = run_dir / METRICS
    current = store.get(job_id)
    first_step_seen = current is not None and current.first_step_at is not None
    watcher = watch_attempt(plan, run_dir, evidence, sink)
    try:
        # All started before any is recorded: a store write (a disk sync) delays the next.
        pids = [(handle, handle.start(functools.partial(sink.line, handle.rank)))
                for handle in handles]
        for handle, pid in pids:
            store.update_rank(job_id, handle.rank, pid=pid, state="RUNNING",
                              started_at=time.time())
        workerranks.started(store, job_id, run.nodes, time.time())
        store.update(job_id, state="RUNNING", started_at=time.time())
        if watcher is not None:
            watcher.alive = frozenset(run.running)
            watcher.start()
        while run.running:
            run.collect()
            run.check_rules(stop.reason)
            run.enforce()
            if watcher is not None:
                watcher.alive = frozenset(run.running)
                diagnosis = watcher.take()
                if diagnosis is not None:
                    _stalled(run, plan, diagnosis)
            if not first_step_seen and metrics.exists():
                first_step_seen = record_first_step(store, job_id, metrics)
            sink.flush()
            if run.running:
                run.pause(POLL_S)
        if watcher is not None and (found := watcher.last_look()) is not None:
            _stalled(run, plan, found)  # a world formed and gone between two looks
    finally:
        if watcher is not None:
            watcher.stop()
        left = cleanup() if cleanup is not None else None
        if not first_step_seen and metrics.exists():
            record_first_step(store, job_id, metrics)
    outcome = run.outcome()
    if left:  # processes that outlived the attempt: named in its ending (noted below)
        outcome.reason = f"{outcome.reason}; {left}" if outcome.reason else left
    sink.note(f"attempt ended {outcome.state}" + (f": {outcome.reason}" if outcome.reason else ""))
    sink.close()
    return outcome


@dataclass
class Launched:
    """One attempt's ranks, ready to start: the handles, what to run after them, the log."""

    handles: Sequence[RankHandle]
    cleanup: Callable[[], str | None] | None = None  # after the ranks: what outlived them
    sink: LogSink | None = None
    evidence: Evidence | None = None  # where the stall watch reads heartbeats


class Attempts(Protocol):
    """What :func:`run_with_restarts` asks of the backend, the one place where control climbs
    from ``run`` to ``backends`` (:class:`orchestrate.backends.supervisor.Supervisor` is it)."""

    def launch(self, attempt: int, excluded: tuple[str, ...]) -> tuple[Plan, Launched]:
        """Ready ``attempt``'s ranks without the ``excluded`` nodes (re-planning where the
        backend must: other hosts, a node excluded); its plan and its ranks."""

    def progress(self, plan: Plan) -> dict[str, int | None]:
        """How far training got (:func:`orchestrate.core.plan.restart.progress_marker`, on the
        right host)."""


def run_with_restarts(job_id: str, run_dir: Path, store: Store, plan: Plan, stop: StopRequest,
                      grace_s: float, attempts: Attempts) -> Outcome:
    """Run the job's attempts until one ends for good; record the job's end.

    The restart policy of :mod:`orchestrate.core.plan.restart` decides between attempts; a
    cancel during the wait ends the job for good.
    """
    record = store.get(job_id)
    attempt = record.attempt if record is not None else 1
    restarts = 0
    excluded: tuple[str, ...] = ()
    expects = plan.train_config is not None
    # Progress only ever turns a restart into none: a job that cannot restart never asks
    # (over SSH each read is a request to rank 0's host).
    before = attempts.progress(plan) if plan.restart.max > 0 else {}
    while True:
        try:
            plan, launched = attempts.launch(attempt, excluded)
        except Exception as exc:  # a restart that cannot launch ends the job, saying why
            why = f"attempt {attempt} could not start: {_launch_error(exc)}"
            store.end_attempt(job_id, time.time(), why)
            _note(run_dir, f"job {job_id} FAILED: {why}")
            store.finish(job_id, "FAILED", why)
            final_report(store, job_id)
            return Outcome("FAILED", why, None)
        outcome = supervise(job_id, run_dir, store, launched.handles, stop, grace_s, plan,
                            launched.cleanup, launched.sink, launched.evidence)
        if stop.reason and outcome.state != "CANCELLED":
            outcome = Outcome("CANCELLED", stop.reason, None)
        after: dict[str, int | None] = {}
        decision = decide(plan.restart, outcome.ending(), restarts, None)
        if decision.restart:  # only then can the attempt's progress change the answer
            after = attempts.progress(plan)
            decision = decide(plan.restart, outcome.ending(), restarts,
                              progressed(before, after, expects))
        resumed = resumed_from(run_dir)
        if not decision.restart:
            # Say why not, unless the policy never covered this ending anyway.
            quiet = outcome.state in ("COMPLETED", "CANCELLED", "TIMEOUT") or \
                decision.why.startswith("not restarted: restart.on does not include")
            reason = outcome.reason if quiet else f"{outcome.reason}; {decision.why}"
            store.end_attempt(job_id, time.time(), reason, resumed)
            _note(run_dir, f"job {job_id} {outcome.state}" + (f": {reason}" if reason else ""))
            store.finish(job_id, outcome.state, reason, failure=outcome.failure)
            final_report(store, job_id)
            return outcome
        why = f"{outcome.reason}; {decision.why}"
        store.end_attempt(job_id, time.time(), why, resumed, decision.exclude)
        store.update(job_id, state=RESTARTING, reason=why, failure=outcome.failure)
        _note(run_dir, f"attempt {attempt} ended {outcome.state}: {why}")
        deadline = time.monotonic() + decision.wait_s
        while time.monotonic() < deadline and not stop.reason:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        if stop.reason:
            store.finish(job_id, "CANCELLED", f"{stop.reason} (between attempts: nothing "
                         "restarted)")
            _note(run_dir, f"job {job_id} CANCELLED between attempts")
            final_report(store, job_id)
            return Outcome("CANCELLED", stop.reason, None)
        restarts += 1
        attempt += 1
        excluded = (*excluded, *decision.exclude)
        before = after
        store.reopen(job_id, Attempt(attempt, time.time(), excluded_nodes=excluded))


def _launch_error(exc: Exception) -> str:
    problems = getattr(exc, "problems", None)
    if problems:
        return "; ".join(p.render().replace("\n", " ") for p in problems)
    failures = getattr(getattr(exc, "verdict", None), "failures", None)
    if failures:
        return "preflight: " + "; ".join(f"{t.label}: {check}: {detail}"
                                         for t, check, detail in failures)
    return f"{type(exc).__name__}: {exc}"


def final_report(store: Store, job_id: str) -> None:
    """The job's HTML report (``report.html`` in its run directory), written when it ends; a
    report that cannot be written never fails the job."""
    from orchestrate.report.runfiles import write_report

    record = store.get(job_id)
    if record is None:
        return
    try:
        write_report(Path(record.run_dir), record.to_json())
    except Exception as exc:  # any failure here is the report's, never the job's
        _note(Path(record.run_dir), f"no report: {type(exc).__name__}: {exc}")


def _note(run_dir: Path, text: str) -> None:
    """A line from orchestrate in the merged view, between attempts (no sink is open then)."""
    with contextlib.suppress(OSError):
        append_note(str(run_dir / MERGED_INDEX), text)
