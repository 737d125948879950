"""The Slurm backend: ``sbatch`` the rendered job.sbatch, then read the job's state back.

``submit`` writes the run directory and submits exactly the ``job.sbatch`` that ``render``
prints; it returns once Slurm has queued the job. The script itself places the ranks, merges
their logs, records how each ended and requeues the job when the ranks checkpointed on the stop
signal (see templates/sbatch.sh.j2). ``refresh`` asks the controller (``scontrol show job``,
never ``sacct`` unless accounting works) and, for a job the controller has forgotten, decides from
what the script left in the run directory, so no caller ever waits for a job that is gone
(:mod:`orchestrate.backends.slurm.view`, which also says which states a Slurm job shows).
There is no supervisor: Slurm is the one watching the ranks.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.backends.base import (
    Backend,
    checked_script,
    new_record,
    rank_files,
    unsafe_error,
    write_run_dir,
)
from orchestrate.backends.slurm.allocation import requeued_by_slurm
from orchestrate.backends.slurm.ctl import (
    FINAL_STATES,
    SlurmClient,
    SlurmError,
    SlurmTimeout,
    parse_job_id,
)
from orchestrate.backends.slurm.record import read_runs
from orchestrate.backends.slurm.version import cluster_version, requeue_options
from orchestrate.backends.slurm.view import (
    SUBMITTING,
    forgotten_view,
    record_view,
    view_of,
)
from orchestrate.core.errors import UserError
from orchestrate.core.layout import SBATCH_SCRIPT, slurm_secrets
from orchestrate.core.plan.outcome import Attempt
from orchestrate.hostside import safeplace
from orchestrate.run.store import JobRecord, Store

if TYPE_CHECKING:
    from orchestrate.core.plan.plan import Plan
    from orchestrate.run.prepare import Prepared

#: How long ``cancel`` waits for Slurm to report every process of the job gone.
CANCEL_WAIT_S = 60.0
POLL_S = 0.5
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
        """Write the run directory and the secrets' file, sbatch its job.sbatch (without the
        secrets in its environment), record the Slurm job id."""
        secrets = _secrets(prepared)
        _check_sbatch()
        run_dir = write_run_dir(prepared, self.files(prepared.plan, prepared.templates_dir))
        _write_secrets(run_dir, secrets, prepared)
        checked_script(prepared, run_dir, SBATCH_SCRIPT)
        submitted_at = time.time()
        try:
            done = self.client.sbatch(Path(SBATCH_SCRIPT), "--parsable",
                                      *self.release_options(prepared.plan), cwd=run_dir,
                                      unset=prepared.plan.secret_env)
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
        secrets = _secrets(prepared)
        _check_sbatch()
        run_dir = write_run_dir(prepared, self.files(prepared.plan, prepared.templates_dir))
        _write_secrets(run_dir, secrets, prepared)
        checked_script(prepared, run_dir, SBATCH_SCRIPT)
        runs = read_runs(run_dir)
        base = runs[-1].restart + 1 if runs else job.attempt
        store.reopen(job.id, Attempt(job.attempt + 1, time.time()))
        store.update(job.id, plan=prepared.plan)
        try:
            done = self.client.sbatch(Path(SBATCH_SCRIPT), "--parsable",
                                      *self.release_options(prepared.plan),
                                      f"--export=ALL,ORCHESTRATE_ATTEMPT_BASE={base}",
                                      cwd=run_dir, unset=prepared.plan.secret_env)
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

    def release_options(self, plan: Plan) -> tuple[str, ...]:
        """sbatch options this cluster's Slurm release has and the job wants: on >= 25.11
        ``--requeue=expedite`` for a job Slurm may requeue (docs/slurm.md, "Slurm releases")."""
        return requeue_options(cluster_version(self.client), requeued_by_slurm(plan))

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
            done = self.client.sbatch(None, "--test-only", text=text,
                                      unset=prepared.plan.secret_env)
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
        view = forgotten_view(job, runs, self.client) if info is None else \
            view_of(job, info, runs, self.client)
        record = record_view(job, store, view, runs)
        if record.terminal:
            forget_secrets(run_dir)
        return record

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

    # ---- cancel --------------------------------------------------------------------------

    def cancel(self, job: JobRecord, store: Store) -> JobRecord:
        """scancel, then wait until Slurm lists nothing of the job any more."""
        if job.state == SUBMITTING:
            job = self._find_submitted(job, store)
            if job.state == SUBMITTING:
                store.finish(job.id, "CANCELLED", "cancelled while its sbatch had not answered; "
                             f"if Slurm queues it later: scancel -n {job.plan.job_name}")
                forget_secrets(Path(job.run_dir))
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
            forget_secrets(Path(job.run_dir))
            return store.get(job.id) or job
        refreshed = self.refresh(store.get(job.id) or job, store)
        if not refreshed.terminal:  # forgotten at once: it was cancelled all the same
            store.finish(job.id, "CANCELLED", "cancelled")
        forget_secrets(Path(job.run_dir))
        return store.get(job.id) or refreshed


def _secrets(prepared: Prepared) -> list[str]:
    from orchestrate.backends.base import secret_values

    return secret_values(prepared.plan.secret_env, str(prepared.path))


def _write_secrets(run_dir: Path, values: list[str], prepared: Prepared) -> None:
    """The secrets for the batch script, one a line, in a file only its owner can read (the
    run directory is 0700 too): never in sbatch's environment, which slurmctld keeps on its
    disk. The batch script removes the file (job.sbatch says when); so does :func:`forget_secrets`
    once the job has ended, whichever way."""
    if not values:
        return
    path = slurm_secrets(run_dir)
    try:  # through the run directory's checked folder (hostside/safeplace.py)
        safeplace.write_tree(run_dir, {path.relative_to(run_dir).as_posix():
                                       "".join(v + "\n" for v in values)})
    except safeplace.UnsafePlace as exc:
        raise unsafe_error(exc.unsafe, str(prepared.path)) from None
    except OSError as exc:
        _remove_run_dir(run_dir)
        raise UserError.single(f"cannot write the job's secrets: {exc.strerror}",
                               source=str(prepared.path), field="run_root",
                               got=str(path)) from None


def forget_secrets(run_dir: Path) -> None:
    """The job has ended for good: nothing may run again that needs its secrets."""
    with contextlib.suppress(OSError):
        slurm_secrets(run_dir).unlink()


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


BACKEND: Backend = SlurmBackend()  # mypy checks it keeps the protocol
