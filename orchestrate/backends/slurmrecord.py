"""What a Slurm job leaves in its run directory, read back: runs, rank exits, the first failure.

job.sbatch appends a ``start`` and an ``end`` line to ``slurm/events.jsonl`` for each run of the
batch script (a requeue starts another run, ``restart`` 1, 2, ...), and every rank writes
``slurm/exits/<restart>/rank-R`` (exit status, time in microseconds, host) when it ends. Slurm
itself keeps none of this without accounting, and forgets the job after ``MinJobAge``: these
files are how a job that vanished from the controller is still decided, and how status names
the rank that failed first.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.layout import (
    SLURM_EVENTS,
    SLURM_STATE,
    rank_log,
    slurm_exit_dir,
    slurm_hostfile,
)
from orchestrate.logsink import last_lines
from orchestrate.train.config import EXIT_REQUEUE


@dataclass(frozen=True)
class RankExit:
    """How one rank ended in one run."""

    rank: int
    status: int  # the shell's $?: 128 + N when signal N killed it
    at_us: int
    host: str

    @property
    def signal(self) -> int | None:
        """The signal that killed the rank, if the status says so."""
        return self.status - 128 if 128 < self.status < 128 + 65 else None

    def describe(self) -> str:
        """``exit code 3`` or ``signal 9 (SIGKILL)``."""
        sig = self.signal
        if sig is None:
            return f"exit code {self.status}"
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "?"
        return f"signal {sig} ({name})"


@dataclass(frozen=True)
class Run:
    """One run of the batch script: its start line and, if it got that far, its end line."""

    restart: int
    start: dict[str, Any]
    end: dict[str, Any] | None

    @property
    def hosts(self) -> list[str]:
        """The host of each plan node in this run."""
        return str(self.start.get("hosts", "")).split()


def read_runs(run_dir: Path) -> list[Run]:
    """Every run of the batch script so far, oldest first (unreadable lines are skipped)."""
    starts: dict[int, dict[str, Any]] = {}
    ends: dict[int, dict[str, Any]] = {}
    try:
        text = (run_dir / SLURM_STATE / SLURM_EVENTS).read_text(encoding="utf-8")
    except OSError:
        return []
    for line in text.splitlines():
        try:
            event = json.loads(line)
            restart = int(event["restart"])
        except (ValueError, KeyError, TypeError):
            continue
        if event.get("event") == "start":
            starts[restart] = event
            ends.pop(restart, None)  # the same restart count again: a fresh start
        elif event.get("event") == "end":
            ends[restart] = event
    return [Run(r, starts[r], ends.get(r)) for r in sorted(starts)]


def rank_exits(run_dir: Path, restart: int) -> dict[int, RankExit]:
    """The exits the ranks of one run recorded, by rank."""
    exits: dict[int, RankExit] = {}
    folder = slurm_exit_dir(run_dir, restart)
    try:
        entries = list(folder.iterdir())
    except OSError:
        return exits
    for path in entries:
        if not path.name.startswith("rank-"):
            continue
        try:
            rank = int(path.name.removeprefix("rank-"))
            status, at_us, host = path.read_text(encoding="utf-8").split()[:3]
            exits[rank] = RankExit(rank, int(status), int(at_us), host)
        except (OSError, ValueError):
            continue
    return exits


def first_failure(run_dir: Path, exits: dict[int, RankExit]) -> dict[str, Any] | None:
    """The rank that failed first (the earliest non-zero exit), in the store's failure form."""
    failed = [e for e in exits.values() if e.status != 0]
    if not failed:
        return None
    first = min(failed, key=lambda e: (e.at_us, e.rank))
    return {
        "rank": first.rank,
        "node": first.host,
        "exit_code": None if first.signal is not None else first.status,
        "signal": first.signal,
        "description": first.describe(),
        "last_lines": last_lines(rank_log(run_dir, first.rank), 10),
        "requeue": first.status == EXIT_REQUEUE,
    }


def rank_hosts(run_dir: Path, restart: int) -> list[str]:
    """The host of each rank in one run (the step's host file), [] before the run placed them."""
    try:
        text = slurm_hostfile(run_dir, restart).read_text(encoding="utf-8")
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]
