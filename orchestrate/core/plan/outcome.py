"""How ranks end, and which one failed first: one record and one rule for every backend.

The local and SSH supervisors see exits as they happen; a Slurm job's ranks record theirs in the
run directory (status, time, host) for the batch job's monitor and for ``orchestrate status``. All
of them turn those facts into :class:`RankEnd` values and ask :func:`first_failure`, so "the
first rank that failed" means the same everywhere: the earliest non-zero exit, the lowest rank on
a tie; but a rank whose last lines explain the failure (its own error, a NaN stop, a factory that
does not import) outranks one that died a moment earlier saying nothing, and both outrank a rank
that says another rank failed first (:func:`says`). Without that, rank 1 exiting 0.1 s before
rank 0 had printed why they both stop sent people to rank 1's empty log. The
:class:`Failure` record is what the job store keeps and ``status`` shows.

Standard library only, Python 3.8+: the Slurm monitor program bundles this module
(:mod:`orchestrate.hostside.shipping`).
"""

from __future__ import annotations

import re
import signal as signals
from dataclasses import dataclass

from orchestrate.core.exits import EXIT_REQUEUE

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from typing import Any


@dataclass(frozen=True)
class Exit:
    """How a process ended: an exit code, or the signal that killed it."""

    code: int | None = None
    signal: int | None = None

    @classmethod
    def from_status(cls, status: int) -> Exit:
        """From a shell's ``$?``, where 128 + N means signal N killed the process."""
        if 128 < status < 128 + 65:
            return cls(signal=status - 128)
        return cls(code=status)

    @property
    def ok(self) -> bool:
        """Exited with status 0."""
        return self.code == 0 and self.signal is None

    @property
    def status(self) -> int:
        """The shell's view of it (128 + N for signal N)."""
        return 128 + self.signal if self.signal is not None else int(self.code or 0)

    def describe(self) -> str:
        """``exit code 3`` or ``signal 9 (SIGKILL)``."""
        if self.signal is not None:
            try:
                name = signals.Signals(self.signal).name
            except ValueError:
                name = "?"
            return f"signal {self.signal} ({name})"
        return f"exit code {self.code}"


@dataclass(frozen=True)
class RankEnd:
    """One rank's end: which rank, on which node (or host), how, and when (epoch seconds)."""

    rank: int
    node: str
    exit: Exit
    at: float


#: How long after the first failure another rank's end may still be the one that explains it
#: (the ranks of one failure end within a second or two of each other, a busy machine included).
SETTLE_S = 3.0

#: What a failed rank's last lines say (:func:`says`), in the order of blame.
EXPLAINED, SILENT, ELSEWHERE = 0, 1, 2

#: orchestrate.train's own line about this rank (``rank 3: ...``, session.py).
_OWN_LINE = re.compile(r"^rank \d+: (.*)$")
#: Words of a rank that failed because another did, or was stopped (``got signal:``: torchrun's
#: agent stopped from outside, ``SignalException: Process 736 got signal: 15``).
_ELSEWHERE = ("another rank", "failed on rank(s)", "connection closed", "connection reset",
              "broken pipe", "remote process", "stopped by sig", "interrupted", "by peer",
              "got signal:")
#: Words of a rank that says why it failed (``exitcode :``: the worker torchrun's report
#: names, its last lines when the worker itself printed nothing).
_ERROR = re.compile(r"Traceback \(most recent call last\)|[a-z](Error|Exception)\b|"
                    r"(?i:\berror:|\bfatal\b|\bsegmentation fault\b|\baborted\b)|"
                    r"^\s*exitcode\s*:\s*-?\d+ \(pid")


def says(lines: Sequence[str]) -> int:
    """Whether a failed rank's last log lines explain its failure (:data:`EXPLAINED`), say
    nothing (:data:`SILENT`) or blame another rank (:data:`ELSEWHERE`: a closed connection, a
    collective that failed, a stop). orchestrate.train's own ``rank N: ...`` line decides when
    there is one; else any line that points elsewhere, then any error line."""
    own = [m.group(1) for m in map(_OWN_LINE.match, lines) if m is not None]
    texts = own[-1:] or list(lines)
    if any(sign in text.lower() for text in texts for sign in _ELSEWHERE):
        return ELSEWHERE
    if own or any(_ERROR.search(text) for text in texts):
        return EXPLAINED
    return SILENT


def first_failure(ends: Iterable[RankEnd],
                  said: Callable[[int], Sequence[str]] | None = None,
                  settle_s: float = SETTLE_S) -> RankEnd | None:
    """The rank that failed first: the earliest non-zero end, the lowest rank on a tie (the
    others were most likely stopped because of it). With ``said`` (a rank's last log lines),
    among the ends within ``settle_s`` of the first, one that explains itself comes before one
    that says nothing, which comes before one that blames another rank (:func:`says`)."""
    failed = [end for end in ends if not end.exit.ok]
    if not failed:
        return None
    if said is None:
        return min(failed, key=lambda end: (end.at, end.rank))
    start = min(end.at for end in failed)
    near = [end for end in failed if end.at <= start + settle_s]
    asked = [end.at for end in failed if end.exit.code == EXIT_REQUEUE]
    requeue_at = min(asked) if asked else None
    return min(near, key=lambda end: (_blame(end, said, requeue_at), end.at, end.rank))


#: Signals a launcher stops the other ranks with once one has ended (srun's kill-on-bad-exit,
#: the supervisors' stop): such an end is a consequence, not a failure of its own.
STOPPED_BY_LAUNCHER = (2, 9, 15)  # SIGINT, SIGKILL, SIGTERM


def _blame(end: RankEnd, said: Callable[[int], Sequence[str]], requeue_at: float | None) -> int:
    """:func:`says` of a failed rank, where a rank the launcher stopped after another rank
    exited 75 (asking to be requeued) blames that rank: srun stops the step once rank 0 has
    checkpointed on the stop signal, and the silent SIGTERM of rank 1 must not come before rank
    0, whose own line ("stopped by SIGUSR2 ...; exiting 75") reads as a stop from outside (CI,
    stop 42: the stop signal was taken for a failure and restarted in the allocation). A rank
    killed *before* any asked stays a failure of its own."""
    if requeue_at is not None and end.exit.signal in STOPPED_BY_LAUNCHER and end.at >= requeue_at:
        return ELSEWHERE
    return says(said(end.rank))


def settled(ends: Sequence[RankEnd], said: Callable[[int], Sequence[str]], running: bool,
            now: float, settle_s: float = SETTLE_S) -> RankEnd | None:
    """The failure to name now (:func:`first_failure`), or None while a rank still running may
    yet explain it: the first failure says nothing (or blames another) and ``settle_s`` has not
    passed since it."""
    first = first_failure(ends, said, settle_s)
    if first is None or not running or says(said(first.rank)) == EXPLAINED:
        return first
    start = min(end.at for end in ends if not end.exit.ok)
    return first if now >= start + settle_s else None


#: torch's words for a collective that ran out of time: gloo's exception ("Timed out waiting
#: 3000ms for recv operation to complete") and nccl's watchdog ("Watchdog caught collective
#: operation timeout: WorkNCCL(SeqNum=668, OpType=ALLREDUCE, ..., Timeout(ms)=600000) ran for
#: 600097 milliseconds before timing out").
_GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms for (?:recv|send) operation to complete")
_NCCL_TIMEOUT = re.compile(
    r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d+), OpType=(\w+)"
    r"[^)]*?Timeout\(ms\)=(\d+)\)")


def collective_timeout(lines: Iterable[str]) -> str | None:
    """``collective timed out after 3 s`` (``... (ALLREDUCE #668)`` from nccl) when a rank's
    last log lines hold torch's timeout message, else None. The process may end in many ways
    after it (an exit code of the program's choosing; SIGABRT from gloo tearing down or from
    nccl's watchdog): the timeout is the cause either way."""
    for line in reversed(list(lines)):
        found = _NCCL_TIMEOUT.search(line)
        if found is not None:
            seconds = int(found.group(3)) / 1000
            return (f"collective timed out after {seconds:g} s "
                    f"({found.group(2)} #{found.group(1)})")
        found = _GLOO_TIMEOUT.search(line)
        if found is not None:
            return f"collective timed out after {int(found.group(1)) / 1000:g} s"
    return None


@dataclass(frozen=True)
class Failure:
    """The first failure of a job, as the store keeps it and ``status`` shows it."""

    rank: int
    node: str
    exit: Exit
    last_lines: list[str]
    cause: str | None = None  # what happened beyond the exit, e.g. "lost contact with h2 ..."

    @classmethod
    def of(cls, end: RankEnd, last_lines: list[str], cause: str | None = None) -> Failure:
        """The failure record of a rank's end, with the last lines of its log."""
        return cls(end.rank, end.node, end.exit, list(last_lines), cause)

    @property
    def requeue(self) -> bool:
        """The rank checkpointed on a stop signal and asks to be started again."""
        return self.exit.code == EXIT_REQUEUE

    def sentence(self) -> str:
        """``rank 3 on h2 failed with exit code 1`` (or what was lost, when a host was; or
        ``rank 0 on h1: collective timed out after 600 s (it then ended with signal 6
        (SIGABRT))`` when its log says so: :func:`collective_timeout`)."""
        if self.cause:
            return f"{self.cause} (rank {self.rank} and every other rank there presumed dead)"
        timeout = collective_timeout(self.last_lines)
        if timeout is not None:
            return (f"rank {self.rank} on {self.node}: {timeout} (it then ended with "
                    f"{self.exit.describe()})")
        return f"rank {self.rank} on {self.node} failed with {self.exit.describe()}"

    def to_json(self) -> dict[str, Any]:
        """The stored form (``status --json`` shows it as ``failure``)."""
        return {
            "rank": self.rank,
            "node": self.node,
            "exit_code": self.exit.code,
            "signal": self.exit.signal,
            "description": self.exit.describe(),
            "last_lines": list(self.last_lines),
            "requeue": self.requeue,
            "cause": self.cause,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Failure:
        """The inverse of :meth:`to_json`."""
        return cls(
            rank=int(data["rank"]),
            node=str(data["node"]),
            exit=Exit(code=data.get("exit_code"), signal=data.get("signal")),
            last_lines=[str(line) for line in data.get("last_lines") or []],
            cause=data.get("cause"),
        )


@dataclass(frozen=True)
class Attempt:
    """One run of a job: a fresh submit is attempt 1; a restart or a resume starts the next.

    ``reason`` says why it ended (the failure or stall sentence, a requeue, a cancel);
    ``excluded_nodes`` the nodes the next attempt avoided because of it; ``resumed_from_step``
    the optimizer step the attempt's training resumed from (None: from scratch or unknown).
    """

    n: int
    started: float
    ended: float | None = None
    reason: str = ""
    excluded_nodes: tuple[str, ...] = ()
    resumed_from_step: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The stored form (``status --json`` shows it under ``attempts``)."""
        return {
            "n": self.n,
            "started": self.started,
            "ended": self.ended,
            "reason": self.reason,
            "excluded_nodes": list(self.excluded_nodes),
            "resumed_from_step": self.resumed_from_step,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Attempt:
        """The inverse of :meth:`to_json`."""
        return cls(
            n=int(data["n"]),
            started=float(data["started"]),
            ended=None if data.get("ended") is None else float(data["ended"]),
            reason=str(data.get("reason") or ""),
            excluded_nodes=tuple(data.get("excluded_nodes") or ()),
            resumed_from_step=data.get("resumed_from_step"),
        )
