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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.backends.slurm.monitor import rank_ends
from orchestrate.core.layout import (
    SLURM_EVENTS,
    SLURM_STATE,
    rank_log,
    slurm_exit_dir,
    slurm_hostfile,
)
from orchestrate.core.plan.outcome import Attempt, Failure, RankEnd, first_failure
from orchestrate.core.plan.plan import Plan
from orchestrate.core.plan.workers import REPORT_LINES, worker_end
from orchestrate.run.logsink import last_lines
from orchestrate.run.store import JobRecord


@dataclass(frozen=True)
class BatchRun:
    """One run of the batch script: its start line and, if it got that far, its end line."""

    restart: int
    start: dict[str, Any]
    end: dict[str, Any] | None

    @property
    def hosts(self) -> list[str]:
        """The host of each plan node in this run."""
        return str(self.start.get("hosts", "")).split()


def read_runs(run_dir: Path) -> list[BatchRun]:
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
    return [BatchRun(r, starts[r], ends.get(r)) for r in sorted(starts)]


def rank_exits(run_dir: Path, restart: int, plan: Plan | None = None) -> dict[int, RankEnd]:
    """How the ranks of one run ended (what each rank's shell recorded), by rank. Under a
    ``per_node`` or ``torchrun`` ``plan`` only a node's one process records its end (as its
    node's first rank); a failed one is the end of the worker its launcher's report names
    (:func:`orchestrate.core.plan.workers.worker_end`), keyed by that worker's rank, so the job
    names the worker that failed, as the local and SSH supervisors do."""
    ends = rank_ends(str(slurm_exit_dir(run_dir, restart)))
    if plan is not None and plan.per_node:
        ends = [worker_end(end, last_lines(rank_log(run_dir, end.rank), REPORT_LINES))
                for end in ends]
    return {end.rank: end for end in ends}


def log_rank(plan: Plan | None, rank: int) -> int:
    """The rank whose log file holds ``rank``'s output: under a per-node launcher its node's
    first (that node's one task writes the node's log), else ``rank`` itself."""
    if plan is not None and plan.per_node:
        for node in plan.nodes:
            if node.first_rank <= rank <= node.last_rank:
                return node.first_rank
    return rank


def job_failure(run_dir: Path, exits: dict[int, RankEnd], plan: Plan | None = None
                ) -> Failure | None:
    """The first failure of a run (:func:`orchestrate.core.plan.outcome.first_failure`), with the
    last lines of that rank's log (a per-node launcher's worker: its node's log)."""
    def said(rank: int) -> list[str]:
        return last_lines(rank_log(run_dir, log_rank(plan, rank)), 10)

    first = first_failure(exits.values(), said)
    if first is None:
        return None
    return Failure.of(first, said(first.rank))


def attempts_of(run_dir: Path, runs: list[BatchRun], job: JobRecord) -> list[Attempt]:
    """Every run of the job as an attempt: when it started and ended, and why it ended (what
    monitor.py decided, or the end event's outcome), kept in the run directory, so requeues
    by Slurm itself (which knows nothing of them) lose nothing."""
    if not runs:
        return list(job.attempts)
    attempts = []
    for i, run in enumerate(runs):
        end = run.end or {}
        later = runs[i + 1] if i + 1 < len(runs) else None
        try:
            reason = (slurm_exit_dir(run_dir, run.restart) / "REASON").read_text(
                encoding="utf-8").strip()
        except OSError:
            reason = str(end.get("reason") or end.get("outcome") or "")
        ended: float | None = float(end["time"]) if end.get("time") else None
        if not end and later is not None:  # it never got to say: Slurm requeued it by itself
            reason = "requeued by Slurm (a node failure or a preemption)"
            ended = float(later.start.get("time") or 0.0) or None
        attempts.append(Attempt(
            n=run.restart + 1,
            started=float(run.start.get("time") or job.submitted_at),
            ended=ended,
            reason=reason if ended is not None else "",
        ))
    return attempts


def rank_hosts(run_dir: Path, restart: int) -> list[str]:
    """The host of each rank in one run (the step's host file), [] before the run placed them."""
    try:
        text = slurm_hostfile(run_dir, restart).read_text(encoding="utf-8")
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]
