"""What every backend does, and what they share.

A backend submits a prepared job, reports its state, cancels it, and checks it without running
it (``submit --dry-run``). ``submit`` returns once the job is launched (or queued); watching it is
the job store's and the log's business, so ``--follow``, ``status``, ``logs`` and ``cancel`` work
the same on every backend. :class:`Backend` lists every entry point the CLI calls.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from orchestrate.core.errors import UserError
from orchestrate.core.layout import LOADED_FILE, PLAN_FILE, SIDECAR_FILE
from orchestrate.core.plan.outcome import Attempt
from orchestrate.hostside.shipping import SHIPPED, module_source
from orchestrate.run.jobrecord import JobRecord, JobState, RankRecord
from orchestrate.run.store import Store

if TYPE_CHECKING:
    from orchestrate.core.plan.plan import Plan
    from orchestrate.run.prepare import Loaded, Prepared

#: How long a rank gets between SIGTERM and SIGKILL (the entrypoint checkpoints in between).
STOP_GRACE_S = 5.0


class Backend(Protocol):
    """A way of running jobs."""

    name: str
    #: How often a follower (``--follow``, ``logs -f``) may ask :meth:`refresh`: a cluster
    #: citizen asks a scheduler every few seconds, a local supervisor's store can answer often.
    poll_interval_s: float

    def submit(self, prepared: Prepared, store: Store) -> JobRecord:
        """Launch (or queue) the job and record it; returns without waiting for it."""

    def refresh(self, job: JobRecord, store: Store) -> JobRecord:
        """Bring the job's recorded state up to date (e.g. a supervisor that vanished)."""

    def cancel(self, job: JobRecord, store: Store) -> JobRecord:
        """Stop every process of the job; returns the record once it is stopped."""

    def files(self, plan: Plan, templates_dir: Path | None) -> dict[str, str]:
        """Every file the job's run directory gets, by name, in a stable order: exactly what
        ``render`` prints and ``submit`` writes. Pure (the plan in, texts out)."""

    def check(self, prepared: Prepared) -> None:
        """``submit --dry-run``: check what can be checked without running anything (a cluster's
        ``sbatch --test-only``, the hosts' preflight), printing the verdict on stderr; a refusal
        is a :class:`~orchestrate.core.errors.UserError`."""

    def resume(self, job: JobRecord, prepared: Prepared, store: Store) -> JobRecord:
        """Run an ended job again as its next attempt: same id, same run directory (so the
        trainer resumes from its checkpoints), planned again from what was loaded at submit
        (``prepared``, made by :func:`reloaded`)."""


def rank_files(plan: Plan, scripts: Mapping[str, str],
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A backend's launch ``scripts``, then what every rank needs beside them: the sidecar
    (loaded as ``sitecustomize``, so no user code changes), a backend's ``extra`` programs, and
    ``train.json`` for a ``train:`` job."""
    from orchestrate.core.render.render import train_config  # Jinja only when files are made

    files = dict(scripts)
    files[SIDECAR_FILE] = module_source(SHIPPED["sidecar"][0])
    files.update(extra or {})
    files.update(train_config(plan))
    return files


def write_run_dir(prepared: Prepared, files: Mapping[str, str]) -> Path:
    """Create the run directory with the backend's ``files`` and the plan; returns it.

    The directory is private (0700): scripts can hold paths and settings a user may not want
    others to read, and secrets never go into it at all.
    """
    run_dir = Path(prepared.plan.run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for name, text in files.items():
            target = run_dir / name
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            target.write_text(text, encoding="utf-8")
            if name.endswith((".sh", ".sbatch")):
                target.chmod(0o700)
        (run_dir / PLAN_FILE).write_text(json.dumps(prepared.plan.to_json(), indent=2) + "\n")
        (run_dir / LOADED_FILE).write_text(json.dumps(prepared.loaded.to_json(), indent=2)
                                           + "\n")
    except OSError as exc:
        raise UserError.single(
            f"cannot write the run directory: {exc.strerror}", source=str(prepared.path),
            field="run_root", got=str(exc.filename or run_dir),
            hint="run directories go under the job's run_root, else $ORCHESTRATE_RUNS, else "
            "./runs: choose a writable place with free space",
        ) from None
    return run_dir


def new_record(prepared: Prepared, state: JobState, submitted_at: float) -> JobRecord:
    """The store record of a job about to be launched."""
    plan = prepared.plan
    return JobRecord(
        id=plan.job_id,
        name=plan.job_name,
        backend=plan.backend,
        state=state,
        run_dir=plan.run_dir,
        plan=plan,
        submitted_at=submitted_at,
        hosts=[n.address for n in plan.nodes],
        ranks=[RankRecord(rank=r.rank, node=r.node) for r in plan.ranks],
        attempts=[Attempt(1, submitted_at)],
    )


def reloaded(job: JobRecord) -> Loaded:
    """What ``job`` was loaded from at submit (its run directory's ``loaded.json``)."""
    from orchestrate.run.prepare import Loaded

    path = Path(job.run_dir) / LOADED_FILE
    try:
        return Loaded.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError) as exc:
        raise UserError.single(
            f"cannot resume: {path} is missing or unreadable ({exc})", field="JOB", got=job.id,
            hint="submit the job file again instead (a new job, starting from scratch)",
        ) from None


def secret_values(names: tuple[str, ...], source: str) -> list[str]:
    """The secret env values from this environment, refusing missing or multi-line ones.

    Secrets reach ranks on standard input (local, SSH) or through sbatch's inherited environment
    (Slurm); they are never written to a file or a command line.
    """
    values = []
    for name in names:
        value = os.environ.get(name)
        if value is None:
            raise UserError.single(
                f"{name} is not set in your environment", source=source, field="secret_env",
                hint=f"export {name}=... before submitting; its value is never written to a file",
            )
        if "\n" in value:
            raise UserError.single(f"{name} holds a line break", source=source,
                                   field="secret_env")
        values.append(value)
    return values
