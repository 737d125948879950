"""The Slurm backend: ``sbatch`` the rendered job.sbatch, then read the job's state back.

``submit`` writes the run directory and submits exactly the ``job.sbatch`` that ``render``
prints; it returns once Slurm has queued the job. The script itself places the ranks, merges
their logs, records how each ended and requeues the job when the ranks checkpointed on the stop
signal (see templates/sbatch.sh.j2). ``refresh`` asks the controller (``scontrol show job``,
never ``sacct`` unless accounting works) and, for a job the controller has forgotten, decides from
what the script left in the run directory, so no caller ever waits for a job that is gone.

States are Slurm's names (PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, CANCELLED, TIMEOUT,
NODE_FAIL, PREEMPTED, ...), with one addition: a job waiting to run again after a requeue is
shown as REQUEUED (Slurm says PENDING with Restarts > 0), with the reason it was requeued.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.backends.base import new_record, rank_files, write_run_dir
from orchestrate.backends.slurm.ctl import (
    FINAL_STATES,
    SlurmClient,
    SlurmError,
    SlurmTimeout,
    parse_job_id,
)
from orchestrate.backends.slurm.record import (
    Run,
    attempts_of,
    job_failure,
    rank_exits,
    rank_hosts,
    read_runs,
)
from orchestrate.core.errors import UserError
from orchestrate.core.layout import METRICS, SBATCH_SCRIPT, slurm_exit_dir
from orchestrate.core.plan.outcome import Attempt, Failure
from orchestrate.diagnosis.evidence import read_diagnosis
from orchestrate.run.store import STOPPED, JobRecord, Store
from orchestrate.run.supervise import final_report

if TYPE_CHECKING:
    from orchestrate.core.plan.plan import Plan
    from orchestrate.run.prepare import Prepared

#: How long ``cancel`` waits for Slurm to report every process of the job gone.
CANCEL_WAIT_S = 60.0
POLL_S = 0.5
#: Shown instead of Slurm's PENDING while a requeued job waits to run again.
REQUEUED = "REQUEUED"
#: A job whose sbatch did not answer: it may be queued; refresh looks it up.
SUBMITTING = "SUBMITTING"
#: How long after such a submit a controller that answers but has no such job means "never
#: queued" (the job's record, the controller's, and the clocks may lag a little).
FIND_GRACE_S = 30.0


class SlurmBackend:
    """Runs jobs through sbatch on the cluster whose clients this machine has."""

    name = "slurm"
    #: Followers ask the controller at most this often (submitit's watcher waits 5 s): every
    #: refresh is an ``scontrol`` RPC to slurmctld, which all of a cluster's users share.
    poll_interval_s = 2.0

    def __init__(self, client: SlurmClient | None = None) -> None:
        self._client = client

    @property
    def client(self) -> SlurmClient:
        """The Slurm clients, with this process's environment (SLURM_CONF included)."""
        if self._client is None:
            self._client = SlurmClient()
        return self._client

    # ---- submit --------------------------------------------------------------------------

    def files(self, plan: Plan, templates_dir: Path | None) -> dict[str, str]:
        """``job.sbatch``, ``monitor.py``, the sidecar and ``train.json``."""
        from orchestrate.backends.slurm.script import batch_files

        return rank_files(plan, batch_files(plan, templates_dir))

    def submit(self, prepared: Prepared, store: Store) -> JobRecord:
        """Write the run directory, sbatch its job.sbatch, record the Slurm job id."""
        _check_secrets(prepared)
        _check_sbatch()
        run_dir = write_run_dir(prepared, self.files(prepared.plan, prepared.templates_dir))
        submitted_at = time.time()
        try:
            done = self.client.sbatch(Path(SBATCH_SCRIPT), "--parsable", cwd=run_dir)
        except SlurmTimeout as exc:
            # The controller may queue it anyway once it answers again: record the job, so
            # that refresh finds it (by name and batch script) instead of leaving it untracked.
            record = new_record(prepared, SUBMITTING, submitted_at)
            record.reason = (f"{exc}; the job may still be queued: status looks it up once the "
                             "controller answers")
            store.add(record)
            _say(f"warning: {record.reason} (orchestrate status {record.id})")
            return record
        except SlurmError as exc:
            _remove_run_dir(run_dir)
            raise UserError.single(str(exc), field="backend", hint=_HINT) from None
        if done.returncode != 0:
            _remove_run_dir(run_dir)
            raise UserError.single(
                "sbatch refused the job: " + _message(done.stderr or done.stdout),
                source=str(prepared.path), hint="`orchestrate submit --dry-run` shows the script"
                " and checks it with sbatch --test-only",
            )
        record = new_record(prepared, "PENDING", submitted_at)
        record.external_id = parse_job_id(done.stdout)
        record.reason = f"Slurm job {record.external_id}"
        store.add(record)
        return record

    def resume(self, job: JobRecord, prepared: Prepared, store: Store) -> JobRecord:
        """The next attempt as a new Slurm job in the same run directory; its runs go on
        counting from the last one (ORCHESTRATE_ATTEMPT_BASE), so no record is overwritten."""
        _check_secrets(prepared)
        _check_sbatch()
        run_dir = write_run_dir(prepared, self.files(prepared.plan, prepared.templates_dir))
        runs = read_runs(run_dir)
        base = runs[-1].restart + 1 if runs else job.attempt
        store.reopen(job.id, Attempt(job.attempt + 1, time.time()))
        store.update(job.id, plan=prepared.plan)
        try:
            done = self.client.sbatch(Path(SBATCH_SCRIPT), "--parsable",
                                      f"--export=ALL,ORCHESTRATE_ATTEMPT_BASE={base}",
                                      cwd=run_dir)
        except SlurmTimeout as exc:
            reason = (f"{exc}; the job may still be queued: status looks it up once the "
                      "controller answers")
            store.update(job.id, state=SUBMITTING, reason=reason)
            _say(f"warning: {reason} (orchestrate status {job.id})")
            return store.get(job.id) or job
        except SlurmError as exc:
            store.finish(job.id, "FAILED", f"resume: {exc}")
            raise UserError.single(str(exc), field="backend", hint=_HINT) from None
        if done.returncode != 0:
            message = _message(done.stderr or done.stdout)
            store.finish(job.id, "FAILED", f"resume: sbatch refused the job: {message}")
            raise UserError.single("sbatch refused the job: " + message, field="JOB")
        external = parse_job_id(done.stdout)
        store.update(job.id, external_id=external, reason=f"Slurm job {external}")
        return store.get(job.id) or job

    def check(self, prepared: Prepared) -> None:
        """Validate the script with ``sbatch --test-only`` when a cluster answers.

        Prints Slurm's verdict on stderr; a refused script is a :class:`UserError` (exit 2).
        """
        if shutil.which("sbatch") is None:
            _say("not checked with sbatch --test-only: sbatch is not on PATH")
            return
        if not self.client.ping():
            _say("not checked with sbatch --test-only: no Slurm controller answered "
                 "`scontrol ping` within 3s")
            return
        text = self.files(prepared.plan, prepared.templates_dir)[SBATCH_SCRIPT]
        try:
            done = self.client.sbatch(None, "--test-only", text=text)
        except SlurmError as exc:
            _say(f"not checked with sbatch --test-only: {exc}")
            return
        if done.returncode != 0:
            raise UserError.single(
                "sbatch --test-only refused the script: " + _message(done.stderr or done.stdout),
                source=str(prepared.path),
                hint="fix the Slurm settings (slurm.*, resources) or the inventory's partition",
            )
        _say("sbatch --test-only: " + _message(done.stderr or done.stdout).removeprefix("sbatch: "))

    # ---- state ---------------------------------------------------------------------------

    def refresh(self, job: JobRecord, store: Store) -> JobRecord:
        """The job's state from the controller, or from its run directory once forgotten."""
        if job.state == SUBMITTING:
            job = self._find_submitted(job, store)
        if job.terminal or job.external_id is None or job.state == SUBMITTING:
            return job
        try:
            info = self.client.show_job(job.external_id)
        except SlurmError as exc:
            # Keep the last known state: the controller may be restarting.
            note = f"Slurm did not answer: {exc}"
            if job.reason != note:
                store.update(job.id, reason=note)
            return store.get(job.id) or job
        run_dir = Path(job.run_dir)
        runs = read_runs(run_dir)
        view = self._vanished(job, runs) if info is None else _view(job, info, runs, self.client)
        return _apply(job, store, view, runs)

    def _find_submitted(self, job: JobRecord, store: Store) -> JobRecord:
        """A job whose sbatch timed out: find it by its name and batch script once the
        controller answers; if the controller has no such job, the submission never happened."""
        script = Path(job.run_dir) / SBATCH_SCRIPT
        try:
            # A resumed job has an earlier Slurm job of the same name and script: a newer one.
            found = self.client.find_batch_job(job.plan.job_name, script, job.external_id)
        except SlurmError as exc:
            note = (f"sbatch did not answer and the controller still does not ({exc}); the job "
                    "may be queued")
            if job.reason != note:
                store.update(job.id, reason=note)
            return store.get(job.id) or job
        if found is not None:
            store.update(job.id, external_id=found, state="PENDING",
                         reason=f"Slurm job {found} (found after sbatch timed out)")
        elif time.time() - job.submitted_at > FIND_GRACE_S:
            store.finish(job.id, "FAILED", "sbatch timed out and the controller never queued "
                         "the job: nothing ran; submit it again")
        return store.get(job.id) or job

    def _vanished(self, job: JobRecord, runs: list[Run]) -> View:
        """The controller no longer knows the job: accounting if it works, else the run dir."""
        assert job.external_id is not None
        accounted = self.client.accounted(job.external_id)
        if accounted is not None and accounted[0] in FINAL_STATES:
            state, code = accounted
            return View(state, f"from accounting: {state} {code}", None)
        last = runs[-1] if runs else None
        forgotten = "the controller forgot the job and there is no accounting to ask"
        if last is None:
            return View("FAILED", f"{forgotten}; it left no sign of having started", None)
        exits = rank_exits(Path(job.run_dir), last.restart)
        failure = job_failure(Path(job.run_dir), exits)
        end = last.end
        if end is None:
            return View("FAILED", f"{forgotten}; its last run (restart {last.restart}) never "
                        "finished (the batch host was lost, or it was killed)", failure)
        outcome = str(end.get("outcome"))
        if outcome == "COMPLETED":
            return View("COMPLETED", f"all {len(job.ranks)} rank(s) exited 0 (the controller "
                        "has forgotten the job; decided from its run directory)", None)
        if outcome == "FAILED":
            return View("FAILED", _failed_reason(failure, end, job, last), failure)
        return View("FAILED", f"{forgotten}; its last run ended {outcome}", failure)

    # ---- cancel --------------------------------------------------------------------------

    def cancel(self, job: JobRecord, store: Store) -> JobRecord:
        """scancel, then wait until Slurm lists nothing of the job any more."""
        if job.state == SUBMITTING:
            job = self._find_submitted(job, store)
            if job.state == SUBMITTING:
                store.finish(job.id, "CANCELLED", "cancelled while its sbatch had not answered; "
                             f"if Slurm queues it later: scancel -n {job.plan.job_name}")
                return store.get(job.id) or job
        if job.terminal or job.external_id is None:
            return job
        done = self.client.cancel(job.external_id)
        if done.returncode != 0 and "already completing or completed" not in done.stderr:
            raise UserError.single(f"scancel failed: {done.describe()}", field="JOB")
        deadline = time.monotonic() + CANCEL_WAIT_S
        info: dict[str, str] | None = None
        while time.monotonic() < deadline:
            info = self.client.show_job(job.external_id)
            final = info is None or info.get("JobState") in FINAL_STATES
            if final and not self.client.in_queue(job.external_id):
                break
            time.sleep(POLL_S)
        else:
            state = info.get("JobState", "?") if info else "?"
            store.finish(job.id, "CANCELLED", f"scancel sent; Slurm still listed the job as "
                         f"{state} after {CANCEL_WAIT_S:.0f}s")
            return store.get(job.id) or job
        refreshed = self.refresh(store.get(job.id) or job, store)
        if not refreshed.terminal:  # forgotten at once: it was cancelled all the same
            store.finish(job.id, "CANCELLED", "cancelled")
        return store.get(job.id) or refreshed


@dataclass(frozen=True)
class View:
    """What the job looks like now: its state, why, and the failing rank if one failed."""

    state: str
    reason: str
    failure: Failure | None
    restarts: int = 0

    @property
    def final(self) -> bool:
        """Whether the job will not run again."""
        return self.state in FINAL_STATES


def _view(job: JobRecord, info: dict[str, str], runs: list[Run], client: SlurmClient) -> View:
    """The job's state from ``scontrol show job`` and the run directory."""
    state = info.get("JobState", "UNKNOWN")
    slurm_reason = info.get("Reason", "None")
    restarts = _int(info.get("Restarts"))
    requeue = info.get("Requeue") == "1"
    run_dir = Path(job.run_dir)
    last = runs[-1] if runs else None
    exits = rank_exits(run_dir, last.restart) if last is not None else {}
    failure = job_failure(run_dir, exits)
    end = last.end if last is not None else None
    max_restarts = job.plan.restart.max
    if (state == "PENDING" and restarts > 0) or (state == "PREEMPTED" and requeue):
        why = _requeue_reason(end, failure, last, client)
        return View(REQUEUED, f"{why}; restart {restarts} of at most {max_restarts} "
                    f"(waiting: {slurm_reason})", None, restarts)
    if state == "PENDING":
        waiting = "queued" if slurm_reason == "None" else f"waiting: {slurm_reason}"
        return View(state, f"Slurm job {job.external_id} {waiting}", None, restarts)
    again = f" (run {restarts + 1}, after {restarts} requeue(s))" if restarts else ""
    if state in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "RESIZING",
                 "SIGNALING", "STAGE_OUT"):
        return View(state, f"Slurm job {job.external_id}{again}", None, restarts)
    if state == "COMPLETED":
        return View(state, f"all {len(job.ranks)} rank(s) exited 0{again}", None, restarts)
    if state == "FAILED":
        return View(state, _failed_reason(failure, end, job, last) + again, failure, restarts)
    # Cancelled, out of time, a node lost: the ranks were stopped, none of them failed.
    if state == "CANCELLED":
        return View(state, "cancelled" + again, None, restarts)
    if state == "TIMEOUT":
        return View(state, f"time limit ({info.get('TimeLimit', '?')}) reached" + again,
                    None, restarts)
    if state == "NODE_FAIL":
        down = _down_nodes(last, info, client)
        not_requeued = "" if requeue else "; not requeued (slurm.requeue_on_node_failure: false)"
        return View(state, f"node failure ({down}){not_requeued}" + again, None, restarts)
    if state in FINAL_STATES:
        return View(state, f"Slurm: {state} ({slurm_reason})" + again, failure, restarts)
    return View(state, f"Slurm: {state} ({slurm_reason})", None, restarts)


def _requeue_reason(end: dict[str, Any] | None, failure: Failure | None,
                    last: Run | None, client: SlurmClient) -> str:
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


def _down_nodes(last: Run | None, info: dict[str, str], client: SlurmClient) -> str:
    hosts = last.hosts if last is not None else []
    states = client.node_states(hosts) if hosts else {}
    down = [n for n, s in states.items() if s not in ("allocated", "idle", "mixed", "completing")]
    if down:
        return ", ".join(f"{n} {states[n]}" for n in down)
    return f"nodes {info.get('NodeList', '?')}"


def _failed_reason(failure: Failure | None, end: dict[str, Any] | None,
                   job: JobRecord, last: Run | None) -> str:
    decided = _decided(Path(job.run_dir), last)
    if decided.startswith("stalled: "):
        # The stall watch stopped the step: the ranks' ends are its doing, not failures.
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
    return "the batch script failed before starting the ranks (see output.log)"


def _decided(run_dir: Path, last: Run | None) -> str:
    """What monitor.py decide said of the last run (its REASON file), or ""."""
    if last is None:
        return ""
    try:
        return (slurm_exit_dir(run_dir, last.restart) / "REASON").read_text(
            encoding="utf-8").strip()
    except OSError:
        return ""


def _apply(job: JobRecord, store: Store, view: View, runs: list[Run]) -> JobRecord:
    """Record the view; the ranks' table too when the state changes."""
    run_dir = Path(job.run_dir)
    fields: dict[str, Any] = {}
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
    if view.final:
        if store.finish(job.id, view.state, view.reason or "", failure=view.failure, **fields):
            final_report(store, job.id)  # the first to see the end writes the report
    elif changed or fields:
        store.update(job.id, state=view.state, reason=view.reason, failure=view.failure,
                     **fields)
    return store.get(job.id) or job


def _update_ranks(job: JobRecord, store: Store, runs: list[Run], view: View) -> None:
    if not runs:
        return
    run_dir = Path(job.run_dir)
    last = runs[-1]
    hosts = rank_hosts(run_dir, last.restart)
    exits = rank_exits(run_dir, last.restart)
    for record in job.ranks:
        fields: dict[str, Any] = {}
        if record.rank < len(hosts):
            fields["host"] = hosts[record.rank]
        ended = exits.get(record.rank)
        if ended is not None:
            # Only the first failure failed; the ranks srun stopped after it (or a cancel, the
            # time limit, a node failure stopped) were stopped, whatever their exit says.
            failed = view.failure is not None and view.failure.rank == record.rank
            fields.update(
                state="COMPLETED" if ended.exit.ok else ("FAILED" if failed else STOPPED),
                exit_code=ended.exit.code, signal=ended.exit.signal, finished_at=ended.at,
            )
        elif view.state == "RUNNING":
            fields.update(state="RUNNING", exit_code=None, signal=None, finished_at=None)
        elif view.final or view.state == REQUEUED:
            fields["state"] = STOPPED if last.start else "PENDING"
        if fields:
            store.update_rank(job.id, record.rank, **fields)


def _first_step(run_dir: Path) -> float | None:
    try:
        with open(run_dir / METRICS, encoding="utf-8") as f:
            first = f.readline()
        return float(json.loads(first).get("time")) if first.strip() else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _check_secrets(prepared: Prepared) -> None:
    from orchestrate.backends.base import secret_values

    # sbatch hands the submitting environment to the job; the values never go into a file.
    secret_values(prepared.plan.secret_env, str(prepared.path))


def _remove_run_dir(run_dir: Path) -> None:
    """A refused submit leaves no run directory that no record points to."""
    shutil.rmtree(run_dir, ignore_errors=True)


def _check_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise UserError.single("sbatch is not on PATH", field="backend", got="slurm",
                               hint=_HINT)


_HINT = "submit from a machine with the Slurm clients, with SLURM_CONF pointing at the cluster"


def _message(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-3:]) or "(no message)"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


BACKEND = SlurmBackend()
