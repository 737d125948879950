"""A Slurm job's state: what ``scontrol`` (or, once it forgot the job, accounting and the run
directory) says, as a :class:`JobView`, and that view recorded in the store.

States are Slurm's names (PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, CANCELLED, TIMEOUT,
NODE_FAIL, PREEMPTED, ...), with two additions: a job waiting to run again after a requeue is
shown as REQUEUED (Slurm says PENDING with Restarts > 0), with the reason it was requeued, and a
job whose sbatch did not answer as SUBMITTING.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from orchestrate.backends.slurm.ctl import FINAL_STATES, SlurmClient, job_state_name
from orchestrate.backends.slurm.healthstep import PREFIX as HEALTH_PREFIX
from orchestrate.backends.slurm.record import (
    BatchRun,
    attempts_of,
    job_failure,
    rank_exits,
    rank_hosts,
)
from orchestrate.core.layout import METRICS, slurm_exit_dir
from orchestrate.core.plan.outcome import Failure, RankEnd
from orchestrate.core.plan.plan import Plan
from orchestrate.diagnosis.evidence import read_diagnosis
from orchestrate.run.jobrecord import (
    RESTARTING,
    STOPPED,
    EndFields,
    JobRecord,
    JobState,
    RankFields,
    job_state,
)
from orchestrate.run.store import Store
from orchestrate.run.supervise import final_report

#: Shown instead of Slurm's PENDING while a requeued job waits to run again.
REQUEUED: JobState = "REQUEUED"
#: A job whose sbatch did not answer: it may be queued; refresh looks it up.
SUBMITTING: JobState = "SUBMITTING"


@dataclass(frozen=True)
class JobView:
    """What the job looks like now: its state, why, and the failing rank if one failed."""

    state: JobState
    reason: str
    failure: Failure | None
    restarts: int = 0

    @property
    def final(self) -> bool:
        """Whether the job will not run again."""
        return self.state in FINAL_STATES


def view_of(job: JobRecord, info: dict[str, str], runs: list[BatchRun],
            client: SlurmClient) -> JobView:
    """The job's state from ``scontrol show job`` and the run directory."""
    named = info.get("JobState", "UNKNOWN")
    # A requeue's flag states are PENDING; one this version does not know is UNKNOWN (the
    # reason names it).
    state = job_state(job_state_name(info))
    slurm_reason = info.get("Reason", "None")
    restarts = _int(info.get("Restarts"))
    requeue = info.get("Requeue") == "1"
    run_dir = Path(job.run_dir)
    last = runs[-1] if runs else None
    exits = rank_exits(run_dir, last.restart, job.plan) if last is not None else {}
    failure = job_failure(run_dir, exits, job.plan)
    end = last.end if last is not None else None
    max_restarts = job.plan.restart.max
    if (state == "PENDING" and restarts > 0) or (state == "PREEMPTED" and requeue):
        why = _requeue_reason(end, failure, last, client, _decided(run_dir, last))
        return JobView(REQUEUED, f"{why}; restart {restarts} of at most {max_restarts} "
                    f"(waiting: {slurm_reason})", None, restarts)
    if state == "PENDING":
        waiting = "queued" if slurm_reason == "None" else f"waiting: {slurm_reason}"
        return JobView(state, f"Slurm job {job.external_id} {waiting}", None, restarts)
    again = f" (run {restarts + 1}, after {restarts} requeue(s))" if restarts else ""
    if state == "RUNNING" and end is not None and end.get("outcome") == "RESTARTED":
        # Between two steps of a restart inside the allocation (the next run not started yet).
        return JobView(RESTARTING, _decided(run_dir, last), None, restarts)
    if state in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "RESIZING",
                 "SIGNALING", "STAGE_OUT"):
        return JobView(state, f"Slurm job {job.external_id}{again}", None, restarts)
    if state == "COMPLETED":
        return JobView(state, f"all {len(job.ranks)} rank(s) exited 0{again}", None, restarts)
    if state == "FAILED":
        text = _failed_reason(failure, end, job, last, info.get("ExitCode", ""))
        return JobView(state, text + again, failure, restarts)
    # Cancelled, out of time, a node lost: the ranks were stopped, none of them failed.
    if state == "CANCELLED":
        return JobView(state, "cancelled" + again, None, restarts)
    if state == "TIMEOUT":
        return JobView(state, f"time limit ({info.get('TimeLimit', '?')}) reached" + again,
                    None, restarts)
    if state == "NODE_FAIL":
        down = _down_nodes(last, info, client)
        not_requeued = "" if requeue else "; not requeued (slurm.requeue_on_node_failure: false)"
        return JobView(state, f"node failure ({down}){not_requeued}" + again, None, restarts)
    if state in FINAL_STATES:
        return JobView(state, f"Slurm: {named} ({slurm_reason})" + again, failure, restarts)
    return JobView(state, f"Slurm: {named} ({slurm_reason})", None, restarts)


def _requeue_reason(end: dict[str, Any] | None, failure: Failure | None,
                    last: BatchRun | None, client: SlurmClient, decided: str = "") -> str:
    if decided.startswith(HEALTH_PREFIX):
        return decided  # the job's own GPU health check requeued it without a node
    if end is not None and end.get("outcome") == "REQUEUED":
        who = f"rank {failure.rank}" if failure else "the ranks"
        return f"requeued: {who} checkpointed on the stop signal and asked to resume"
    if last is None:
        return "requeued by Slurm before it ran"
    down = [n for n, s in client.node_states(last.hosts).items()
            if s.rstrip("*~#!%$@^-") in ("down", "drained", "draining", "fail", "failing")
            or s.endswith("*")]
    if down:
        return f"requeued by Slurm after node failure ({', '.join(down)} not responding)"
    return "requeued by Slurm (node failure, preemption or `scontrol requeue`)"


def _down_nodes(last: BatchRun | None, info: dict[str, str], client: SlurmClient) -> str:
    hosts = last.hosts if last is not None else []
    states = client.node_states(hosts) if hosts else {}
    down = [n for n, s in states.items() if s not in ("allocated", "idle", "mixed", "completing")]
    if down:
        return ", ".join(f"{n} {states[n]}" for n in down)
    return f"nodes {info.get('NodeList', '?')}"


def _failed_reason(failure: Failure | None, end: dict[str, Any] | None,
                   job: JobRecord, last: BatchRun | None, exit_code: str = "") -> str:
    decided = _decided(Path(job.run_dir), last)
    if decided.startswith(("stalled: ", "wrong world: ", HEALTH_PREFIX)):
        # The stall watch (or the world check) stopped the step: the ranks' ends are its
        # doing, not failures; the GPU health check let none start.
        return decided
    if failure is not None:
        if failure.requeue and decided:
            return decided  # why the batch job did not requeue it, in its own words
        text = failure.sentence()
        if failure.requeue:
            limit = job.plan.restart.max
            text += (f" (it checkpointed and asked to resume, but the job was requeued "
                     f"{limit} time(s) already: restart.max)")
        return text
    if end is not None and end.get("outcome") == "FAILED":
        return (f"srun failed with exit code {end.get('srun_exit')} before any rank reported "
                "(see the slurm-*.out file in the run directory)")
    # The batch script itself died before its step (a failing command of its own, bash
    # missing on the batch host): Slurm's ExitCode is the script's status, e.g. 3:0.
    code = f" with Slurm ExitCode={exit_code}" if exit_code else ""
    return (f"the batch script failed{code} before starting the ranks (see the slurm-*.out "
            f"file in the run directory, and orchestrate logs {job.id})")


def _decided(run_dir: Path, last: BatchRun | None) -> str:
    """What monitor.py decide said of the last run (its REASON file), or ""."""
    if last is None:
        return ""
    try:
        return (slurm_exit_dir(run_dir, last.restart) / "REASON").read_text(
            encoding="utf-8").strip()
    except OSError:
        return ""


def record_view(job: JobRecord, store: Store, view: JobView, runs: list[BatchRun]) -> JobRecord:
    """Record the view; the ranks' table too when the state changes."""
    run_dir = Path(job.run_dir)
    fields: EndFields = {}
    if runs and job.started_at is None:
        fields["started_at"] = float(runs[0].start.get("time") or time.time())
    if runs:
        hosts = runs[-1].hosts
        if hosts and hosts != job.hosts:
            fields["hosts"] = hosts
    if job.first_step_at is None:
        stamp = _first_step(run_dir)
        if stamp is not None:
            fields["first_step_at"] = stamp
    attempts = attempts_of(run_dir, runs, job)
    if attempts and attempts != job.attempts:
        fields["attempts"] = attempts
    found = read_diagnosis(run_dir)  # the stall watch in the batch job keeps it there
    diagnosis = None if found is None else found.to_json()
    if diagnosis is not None and diagnosis != job.diagnosis and \
            float(diagnosis.get("at") or 0) >= job.submitted_at:
        fields["diagnosis"] = diagnosis
    changed = view.state != job.state or view.reason != job.reason
    if changed or view.final:
        _update_ranks(job, store, runs, view)
    news = changed or bool(fields)
    fields["failure"] = view.failure
    if view.final:
        if store.finish(job.id, view.state, view.reason or "", **fields):
            final_report(store, job.id)  # the first to see the end writes the report
    elif news:
        store.update(job.id, state=view.state, reason=view.reason, **fields)
    return store.get(job.id) or job


def _update_ranks(job: JobRecord, store: Store, runs: list[BatchRun], view: JobView) -> None:
    if not runs:
        return
    run_dir = Path(job.run_dir)
    last = runs[-1]
    hosts = rank_hosts(run_dir, last.restart)
    exits = with_workers(job.plan, rank_exits(run_dir, last.restart, job.plan))
    for record in job.ranks:
        fields: RankFields = {}
        if record.rank < len(hosts):
            fields["host"] = hosts[record.rank]
        ended = exits.get(record.rank)
        if ended is not None:
            # Only the first failure failed; the ranks srun stopped after it (or a cancel, the
            # time limit, a node failure stopped) were stopped, whatever their exit says.
            failed = view.failure is not None and view.failure.rank == record.rank
            fields["state"] = "COMPLETED" if ended.exit.ok else ("FAILED" if failed else STOPPED)
            fields["exit_code"], fields["signal"] = ended.exit.code, ended.exit.signal
            fields["finished_at"] = ended.at
        elif view.state == "RUNNING":
            fields["state"] = "RUNNING"
            fields["exit_code"] = fields["signal"] = fields["finished_at"] = None
        elif view.final or view.state == REQUEUED:
            fields["state"] = STOPPED if last.start else "PENDING"
        if fields:
            store.update_rank(job.id, record.rank, **fields)


def with_workers(plan: Plan, exits: dict[int, RankEnd]) -> dict[int, RankEnd]:
    """``exits`` with, under ``per_node`` and ``torchrun``, every rank of a node ending as its
    node's one process did (only that process writes an exit, under its node's first rank, or
    under the worker its launcher named as failed: :func:`~.record.rank_exits`): a COMPLETED
    job's workers are COMPLETED, and a failed node's ranks other than the failed worker are
    STOPPED (``_update_ranks`` marks FAILED only the job's failure)."""
    if not plan.per_node:
        return exits
    out = dict(exits)
    for node in plan.nodes:
        ranks = range(node.first_rank, node.last_rank + 1)
        ended = next((exits[rank] for rank in ranks if rank in exits), None)
        if ended is not None:
            for rank in ranks:
                out.setdefault(rank, replace(ended, rank=rank))
    return out


def _first_step(run_dir: Path) -> float | None:
    try:
        with open(run_dir / METRICS, encoding="utf-8") as f:
            first = f.readline()
        return float(json.loads(first).get("time")) if first.strip() else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def forgotten_view(job: JobRecord, runs: list[BatchRun], client: SlurmClient) -> JobView:
    """The controller no longer knows the job: accounting if it works, else the run dir."""
    assert job.external_id is not None
    accounted = client.accounted(job.external_id)
    if accounted is not None and accounted[0] in FINAL_STATES:
        state, code = accounted
        return JobView(job_state(state), f"from accounting: {state} {code}", None)
    last = runs[-1] if runs else None
    forgotten = "the controller forgot the job and there is no accounting to ask"
    if last is None:
        return JobView("FAILED", f"{forgotten}; it left no sign of having started", None)
    exits = rank_exits(Path(job.run_dir), last.restart, job.plan)
    failure = job_failure(Path(job.run_dir), exits, job.plan)
    end = last.end
    if end is None:
        return JobView("FAILED", f"{forgotten}; its last run (restart {last.restart}) never "
                    "finished (the batch host was lost, or it was killed)", failure)
    outcome = str(end.get("outcome"))
    if outcome == "COMPLETED":
        return JobView("COMPLETED", f"all {len(job.ranks)} rank(s) exited 0 (the controller "
                    "has forgotten the job; decided from its run directory)", None)
    if outcome == "FAILED":
        return JobView("FAILED", _failed_reason(failure, end, job, last), failure)
    return JobView("FAILED", f"{forgotten}; its last run ended {outcome}", failure)


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0
