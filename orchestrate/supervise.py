"""The supervisor: the one process that watches every rank of a running job.

It starts the ranks (through a backend's :class:`RankHandle`), copies their output into the
log sink, records each exit in the store, and enforces the failure rule: the first rank that
fails is named (rank, node, exit status, last log lines) and every other rank is stopped within
seconds instead of waiting in a collective for torch's timeout. A cancel (SIGTERM/SIGINT/SIGHUP
to the supervisor) stops every rank the same way. Local and SSH jobs share this loop; only the
handles differ.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from orchestrate.layout import METRICS, rank_log
from orchestrate.logsink import LogSink, last_lines
from orchestrate.store import Store

#: Exit status of a rank that checkpointed and asks to be started again (see orchestrate.train).
EXIT_REQUEUE = 75
POLL_S = 0.05
#: A rank that exited 0 while others still run this long later is reported: in DDP the others
#: are probably waiting for it in a collective. Reported, not killed: rank 0 may legitimately
#: finish alone (a final evaluation or save).
EARLY_EXIT_NOTICE_S = 10.0


@dataclass(frozen=True)
class Exit:
    """How a rank ended: an exit code, or the signal that killed it."""

    code: int | None = None
    signal: int | None = None

    @property
    def ok(self) -> bool:
        """Exited with status 0."""
        return self.code == 0

    def describe(self) -> str:
        """``exit code 3`` or ``signal 9 (SIGKILL)``."""
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = "?"
            return f"signal {self.signal} ({name})"
        return f"exit code {self.code}"


class RankHandle(Protocol):
    """One rank, however it is run (a local process, an SSH channel)."""

    rank: int
    node: str

    def start(self, emit: Callable[[str], None]) -> int | None:
        """Start the rank; ``emit`` gets each output line. Returns its pid if known."""

    def poll(self) -> Exit | None:
        """The exit, once the rank has ended."""

    def stop(self, force: bool) -> None:
        """Ask the rank to stop (SIGTERM), or make it (SIGKILL) when ``force``."""


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
    """How the job ended."""

    state: str
    reason: str
    failure: dict[str, object] | None


def supervise(
    job_id: str,
    run_dir: Path,
    store: Store,
    handles: Sequence[RankHandle],
    stop: StopRequest,
    grace_s: float = 5.0,
    cleanup: Callable[[], None] | None = None,
) -> Outcome:
    """Run the ranks to the end; returns (and records) the outcome."""
    sink = LogSink(run_dir, {h.rank: h.node for h in handles})
    metrics = run_dir / METRICS
    running: dict[int, RankHandle] = {}
    failure: dict[str, object] | None = None
    exits: dict[int, Exit] = {}
    cancel_reason: str | None = None
    stop_deadline: float | None = None
    early_exit: tuple[int, str, float] | None = None  # rank, node, when
    first_step_seen = False
    try:
        for handle in handles:
            pid = handle.start(_emitter(sink, handle.rank))
            running[handle.rank] = handle
            store.update_rank(job_id, handle.rank, pid=pid, state="RUNNING",
                              started_at=time.time())
        store.update(job_id, state="RUNNING", started_at=time.time())
        while running:
            for rank, handle in list(running.items()):
                result = handle.poll()
                if result is None:
                    continue
                del running[rank]
                exits[rank] = result
                store.update_rank(
                    job_id, rank, state="COMPLETED" if result.ok else "FAILED",
                    exit_code=result.code, signal=result.signal, finished_at=time.time(),
                )
                if result.ok:
                    if early_exit is None:
                        early_exit = (rank, handle.node, time.monotonic())
                    continue
                if failure is None and cancel_reason is None:
                    failure = {
                        "rank": rank,
                        "node": handle.node,
                        "exit_code": result.code,
                        "signal": result.signal,
                        "description": result.describe(),
                        "last_lines": last_lines(rank_log(run_dir, rank), 10),
                        "requeue": result.code == EXIT_REQUEUE,
                    }
                    sink.note(
                        f"rank {rank} on {handle.node} failed with {result.describe()}; "
                        f"stopping the other {len(running)} rank(s)"
                    )
                    stop_deadline = _stop_all(running.values(), grace_s)
            if (
                early_exit is not None
                and running
                and stop_deadline is None
                and time.monotonic() - early_exit[2] > EARLY_EXIT_NOTICE_S
            ):
                rank, node, _ = early_exit
                early_exit = (rank, node, float("inf"))
                notice = (
                    f"rank {rank} on {node} exited 0 more than {EARLY_EXIT_NOTICE_S:.0f}s ago "
                    f"while rank(s) {sorted(running)} still run; if they wait for it in a "
                    "collective they will fail at the process-group timeout"
                )
                sink.note(notice)
                store.update(job_id, reason=notice)
            if stop.reason and cancel_reason is None and failure is None:
                cancel_reason = stop.reason
                sink.note(f"{cancel_reason}; stopping {len(running)} rank(s)")
                stop_deadline = _stop_all(running.values(), grace_s)
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                for handle in running.values():
                    handle.stop(force=True)
                stop_deadline = time.monotonic() + 5.0
            if not first_step_seen and metrics.exists():
                first_step_seen = _record_first_step(store, job_id, metrics)
            time.sleep(POLL_S)
    finally:
        if cleanup is not None:
            cleanup()
        if not first_step_seen and metrics.exists():
            _record_first_step(store, job_id, metrics)
    outcome = _outcome(exits, failure, cancel_reason)
    sink.note(f"job {job_id} {outcome.state}" + (f": {outcome.reason}" if outcome.reason else ""))
    sink.close()
    store.finish(job_id, outcome.state, outcome.reason, failure=outcome.failure)
    return outcome


def _emitter(sink: LogSink, rank: int) -> Callable[[str], None]:
    def emit(text: str) -> None:
        sink.line(rank, text)

    return emit


def _stop_all(handles: Iterable[RankHandle], grace_s: float) -> float:
    for handle in list(handles):
        handle.stop(force=False)
    return time.monotonic() + grace_s


def _record_first_step(store: Store, job_id: str, metrics: Path) -> bool:
    try:
        first = metrics.read_text(encoding="utf-8").splitlines()[:1]
        if not first:
            return False
        stamp = float(json.loads(first[0]).get("time", time.time()))
    except (OSError, ValueError, AttributeError):
        return False
    store.update(job_id, first_step_at=stamp)
    return True


def _outcome(
    exits: dict[int, Exit], failure: dict[str, object] | None, cancel_reason: str | None
) -> Outcome:
    if cancel_reason is not None:
        return Outcome("CANCELLED", cancel_reason, None)
    if failure is not None:
        reason = f"rank {failure['rank']} on {failure['node']} failed with {failure['description']}"
        if failure.get("requeue"):
            reason += " (it checkpointed and asks to be resubmitted to resume)"
        return Outcome("FAILED", reason, failure)
    if all(e.ok for e in exits.values()):
        return Outcome("COMPLETED", "", None)
    return Outcome("FAILED", "a rank failed", None)
