"""Ranks that outlive the job's work, and how long the supervisor lets them.

Two ways a job can have nothing left to do while a process of it still runs:

- rank 0 finished (exit 0) while other ranks still run. They may be waiting for it in a
  collective, which fails at the process-group timeout; past ``distributed.timeout_s`` +
  :data:`LINGER_SLACK_S` no collective can still be waiting, so they are stopped (FAILED). A rank
  that finished before the others is only noted (after :data:`EARLY_EXIT_NOTICE_S`): rank 0 may
  finish alone (a final save), and the others may be doing the same.
- every running rank ended its program and hangs in its exit (the stall watch named them: kind
  ``teardown``, an object freed in the interpreter's teardown blocks it, such as a process group
  that a DDP model still holds). No process-group timeout ends that: under ``on_stall: report``
  such a job would hold its GPUs until its time limit, or forever without one (rank 0 hung in
  its exit never starts the rule above). The same bound applies, counted from when the watch
  named them: a healthy exit that long (an atexit join of a child process still at work) is
  not one a job is kept for. ``on_stall: kill`` stops them when named, as any stall.

:class:`Linger` holds when each happened and says what is due; the supervisor
(:mod:`orchestrate.run.supervise`) writes the notes and stops the ranks. The Slurm batch job's
watch (``monitor.py``) applies the second rule with :func:`linger_s`, given in its settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from orchestrate.diagnosis.stall import TEARDOWN
from orchestrate.run.knobs import seconds

#: A rank that exited 0 while others still run this long later is reported (DDP peers wait for
#: it?), not killed: rank 0 may finish alone, a final save (testing knob: run/knobs.py).
EARLY_EXIT_NOTICE_S = seconds("ORCHESTRATE_EARLY_EXIT_NOTICE_S", 10.0)
#: Past the process-group timeout, how long ranks may outlive a finished rank 0, or linger in
#: their exit once named.
LINGER_SLACK_S = seconds("ORCHESTRATE_LINGER_SLACK_S", 30.0)


def linger_s(timeout_s: float) -> float:
    """How long ranks may outlive a finished rank 0, or hang in their exit once named."""
    return timeout_s + LINGER_SLACK_S


@dataclass(frozen=True)
class Due:
    """Ranks to stop now: why, and whether they hang in their exit (an ending the restart
    policy sees as a stall) rather than outlive a finished rank 0."""

    reason: str
    hung: bool


@dataclass
class Linger:
    """When ranks began to outlive the job's work (monotonic seconds), and what is due."""

    linger_s: float
    first_done: tuple[int, str, float] | None = None  # the first rank to exit 0: rank, node
    zero_done_at: float | None = None  # when rank 0 exited 0
    hung_at_exit: float | None = None  # when the watch named ranks hung in their exit
    noticed_early: bool = False

    def exited(self, rank: int, node: str, now: float) -> None:
        """A rank exited 0."""
        if self.first_done is None:
            self.first_done = (rank, node, now)
        if rank == 0:
            self.zero_done_at = now

    def named(self, kind: str, now: float) -> str | None:
        """The watch named a stall of ``kind`` under ``on_stall: report``. Ranks hung in their
        exit (``teardown``) have nothing to go on with: their time starts (at the first such
        naming), and this says, for the stall's note, when they are stopped. None for every
        other kind: the job goes on."""
        if kind != TEARDOWN:
            return None
        if self.hung_at_exit is None:
            self.hung_at_exit = now
        return (f"distributed.on_stall: report: they are stopped if still not exited "
                f"{self.linger_s - (now - self.hung_at_exit):.0f}s from now")

    def notice(self, now: float, others: Sequence[int]) -> str | None:
        """The one note that a rank finished before ``others``, once it is due."""
        if self.first_done is None or self.noticed_early:
            return None
        rank, node, done_at = self.first_done
        if now - done_at <= EARLY_EXIT_NOTICE_S:
            return None
        self.noticed_early = True
        notice = (f"rank {rank} on {node} exited 0 more than {EARLY_EXIT_NOTICE_S:.0f}s ago "
                  f"while rank(s) {list(others)} still run; ")
        if rank == 0:
            return notice + (f"they are stopped if still running {self.linger_s:.0f}s after "
                             f"it (distributed.timeout_s + {LINGER_SLACK_S:.0f}s)")
        return notice + ("if they wait for it in a collective they will fail at the "
                         "process-group timeout")

    def overdue(self, now: float, others: Sequence[int]) -> Due | None:
        """Whether ``others`` (the ranks still running) are to be stopped now, and why."""
        if self.hung_at_exit is not None and now - self.hung_at_exit > self.linger_s:
            return Due(f"rank(s) {list(others)} ended their programs but still had not exited "
                       f"{now - self.hung_at_exit:.0f}s after they were named (longer than "
                       f"distributed.timeout_s + {LINGER_SLACK_S:.0f}s: a hang in the "
                       "interpreter's teardown, which no process-group timeout ends)", hung=True)
        if self.zero_done_at is not None and now - self.zero_done_at > self.linger_s:
            return Due(f"rank(s) {list(others)} still ran {now - self.zero_done_at:.0f}s after "
                       "rank 0 finished (longer than distributed.timeout_s + "
                       f"{LINGER_SLACK_S:.0f}s: not waiting for a collective any more)",
                       hung=False)
        return None
