"""The failure path of one rank's checkup: say what failed, and on rank 0 decide whom to blame.

A rank whose step fails (an error, its watchdog's bound, or rank 0 telling it to stop) reports
to rank 0 through the store's side connection. Rank 0 then tells every rank to stop, waits
:data:`GRACE_S` for their reports (:meth:`Control.accounts`), names the culprit
(:func:`orchestrate.doctor.checkup.blame.blame`) and writes the result. A rank other than 0
waits (at most :data:`LINGER_S`) until rank 0 has written it before it exits non-zero:
launchers stop every rank at the first non-zero exit, and rank 0 must not be stopped before it
said whom to blame. A rank that cannot tell rank 0 writes its own file instead.

Only one thread takes the path: the step's own thread or the watchdog's, whichever comes first;
the other waits for the process to exit.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING

from orchestrate.doctor.checkup.blame import Kind, Report, blame, one_line
from orchestrate.doctor.checkup.result import CheckupFailure

if TYPE_CHECKING:
    from orchestrate.doctor.checkup.control import Control

#: The steps of the smoke tier (any other step fails the bandwidth tier, when it runs).
SMOKE_STEPS = frozenset({"join", "init", "monitored_barrier", "barrier", "all_reduce"})
#: Grace for the other ranks to report after a failure (their watchdogs poll every second).
GRACE_S = 4.0
#: How long a failed rank other than 0 waits for rank 0 to print the result before it exits.
LINGER_S = GRACE_S + 8.0

#: Writes a failure as this rank's result: ``(failure, own_file)`` where ``own_file`` means
#: this rank's own result file (a rank other than 0), not the checkup's.
Record = Callable[[CheckupFailure, bool], None]


class FailurePath:
    """What one rank does when a step fails (see the module docstring)."""

    def __init__(self, control: Control, rank: int, node: str, tiers: Sequence[str],
                 record: Record) -> None:
        self.control = control
        self.rank = rank
        self.node = node
        self.tiers = tuple(tiers)
        self.record = record
        #: Rank -> its node, once the roster is known (rank 0 blames by node).
        self.node_of: dict[int, str] = {}
        self.failing = False
        self._lock = threading.Lock()

    def expired(self, step: str, kind: str, detail: str) -> None:
        """The watchdog's way in (its thread): a step timed out, or rank 0 said stop."""
        self.fail(step, "timeout" if kind == "timeout" else "collective", detail,
                  aborted=kind == "aborted")

    def poll(self) -> str | None:
        """The watchdog's question, every second: should this rank stop?"""
        if self.failing:
            return None
        if self.rank == 0:
            return "another rank reported a failure" if self.control.failures() > 0 else None
        return self.control.stop_reason()

    def _first(self) -> bool:
        """Whether this thread is the first on the failure path (the other one waits for the
        process to exit)."""
        with self._lock:
            if self.failing:
                return False
            self.failing = True
            return True

    def fail(self, step: str, kind: Kind, detail: str, aborted: bool = False) -> None:
        """Report a failure of this rank; on rank 0, also find whom to blame and write the
        result (or never return, when another thread got here first and exits the
        process)."""
        if not self._first():
            threading.Event().wait(GRACE_S + 20)
            return
        tier = "smoke" if step in SMOKE_STEPS or "bandwidth" not in self.tiers else "bandwidth"
        report = {"step": step, "kind": "aborted" if aborted else kind, "detail": detail}
        told_master = False
        try:
            self.control.report_failure(report)
            told_master = True
        except Exception as exc:
            report["detail"] += f" (and rank 0's store did not answer: {one_line(exc)})"
        if self.rank == 0 and told_master:
            failure = self._collect(tier, step)
            self.record(failure, False)
            print(f"checkup: FAILED in {failure.step}: {failure.detail}", file=sys.stderr,
                  flush=True)
            with suppress(Exception):
                self.control.mark_done()
            return
        verb = "stopped" if aborted else "failed"
        said = detail if aborted else report["detail"]
        print(f"checkup: rank {self.rank} ({self.node}) {verb} in {step}: {said}",
              file=sys.stderr, flush=True)
        if not told_master or self.rank == 0:
            self.record(self._own(tier, step, report["detail"]), self.rank != 0)
        if told_master and self.rank != 0:
            self.control.wait_done(LINGER_S)

    def alone(self, step: str, detail: str) -> None:
        """A failure before rank 0 can be told: print it and write this rank's own file."""
        with self._lock:
            self.failing = True
        failure = self._own("smoke", step, detail)
        self.record(failure, self.rank != 0)
        print(f"checkup: {failure.detail}", file=sys.stderr, flush=True)

    def _own(self, tier: str, step: str, detail: str) -> CheckupFailure:
        return CheckupFailure(tier=tier, step=step,
                       detail=f"rank {self.rank} ({self.node}) failed in {step}: {detail}",
                       ranks=(self.rank,), nodes=(self.node,), per_rank={self.rank: detail})

    def _collect(self, tier: str, step: str) -> CheckupFailure:
        """Rank 0: stop everyone, wait for their reports, and decide whom to blame."""
        with suppress(Exception):
            self.control.stop_all(f"rank 0 stopped the checkup: a rank failed in {step}")
        failed, silent, last = self.control.accounts(GRACE_S)
        reports: dict[int, Report] = {}
        aborted: dict[int, Report] = {}
        for r, data in failed.items():
            kind = data["kind"]
            rep = Report(str(data["step"]), "collective" if kind == "aborted" else kind,
                         str(data["detail"]))
            (aborted if kind == "aborted" else reports)[r] = rep
        if not reports and aborted:
            reports = aborted  # everyone was waiting: name them all
        failure = blame(tier, step, reports, silent, last, self.node_of)
        for r, rep in aborted.items():
            failure.per_rank.setdefault(r, f"{rep.step}: waiting ({rep.detail})")
        return failure
