"""What every backend does, and what they share; the lifecycle of a job, backend by backend.

A backend submits a prepared job, reports its state, cancels it, and checks it without running
it (``submit --dry-run``). ``submit`` returns once the job is launched (or queued); watching it is
the job store's and the log's business, so ``--follow``, ``status``, ``logs`` and ``cancel`` work
the same on every backend. :class:`Backend` lists every entry point the CLI calls.

**Local and SSH: one lifecycle** (:class:`~orchestrate.backends.detached.DetachedBackend`, and
:class:`~orchestrate.backends.supervisor.Supervisor` on the other side of the pipe). Each job
runs under a supervisor process of its own, and *the supervisor writes everything*:

1. ``submit`` (the CLI): ``prepare`` loads and plans the job (pure); the backend refuses what
   it can without starting anything (secrets not set; locally, a missing workdir or another
   machine's node), makes the run directory (for the supervisor's log, nothing else), starts
   the supervisor in its own session (``submit`` started its process before planning:
   :mod:`orchestrate.backends.early`) and hands it a
   :class:`~orchestrate.backends.handshake.Handshake`: the job as loaded, and its plan.
2. The supervisor **claims** what the job needs: local, GPUs, CPU slots and a port in this
   machine's lease book, under its lock, re-planned around what other jobs hold, the
   supervisor itself the holder; SSH, preflight on every host, a re-plan with what they said,
   and a claim in each host's lease book through the agent of the host's first rank channel,
   that agent the holder (:mod:`~orchestrate.backends.ssh.launcher`). Then it **writes the run
   directory** (the backend's files, ``plan.json``, ``loaded.json``; SSH first copies each
   host's files there, and writes ``ssh-hosts.json``), then **records** the job in the store
   (a new record, or ``resume``'s next attempt of the old one) with its own pid and host. Until
   its verdict it waits for a locked store as long as the CLI would (then the submit is
   refused, saying so); afterwards as long as it takes to record how the job went.
3. Only then does it answer ``submit``: a :class:`~orchestrate.backends.handshake.Verdict`,
   and ``submit`` returns the record. A refusal before that (a failed preflight, GPUs held, the
   job id taken) is a verdict with the problems: the claims are released and nothing is
   recorded; the run directory holds the supervisor's log only.
4. It runs the attempts (:func:`orchestrate.run.supervise.run_with_restarts`). A restart
   re-claims, re-writes and re-records on SSH (it is planned again, maybe without a node); a
   local restart keeps its leases and run directory. The supervisor records the end, writes
   ``report.html``, and releases the leases as it exits (locally also its watchdog, if it is
   killed; on SSH the agents, when their channels close).
5. ``refresh``: a job not ended whose supervisor is gone failed ("the job's supervisor process
   vanished"); whatever it left is stopped from the CLI (``stop_everywhere``). ``cancel``:
   SIGTERM to the supervisor, which stops every rank its way and exits; one that has not
   within :data:`~orchestrate.backends.detached.CANCEL_GRACE_S` is SIGKILLed and the job
   stopped from the CLI.

**Slurm** has no supervisor: ``submit`` writes the run directory, runs ``sbatch`` and records
the job (Slurm's job id in it); Slurm holds the resources and runs the ranks; ``refresh`` reads
``scontrol`` and the run directory; ``cancel`` is ``scancel`` (:mod:`~orchestrate.backends.slurm`).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from orchestrate.core.errors import UserError
from orchestrate.core.layout import LOADED_FILE, PLAN_FILE, SIDECAR_DIR
from orchestrate.core.plan.outcome import Attempt
from orchestrate.hostside import safeplace
from orchestrate.hostside.shipping import Manifest, compact, program
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
    folder (its ``sitecustomize.py`` and private package, loaded at start-up, so no user code
    changes), a backend's ``extra`` programs, and ``train.json`` for a ``train:`` job."""
    # Only when files are made (a supervisor, a dry run), not on every CLI start: Jinja, and
    # the sidecar's modules (10 ms of a local submit's path to its first rank).
    from orchestrate.core.render.render import train_config
    from orchestrate.diagnosis.rankpackage import folder as sidecar_folder

    files = dict(scripts)
    files.update({f"{SIDECAR_DIR}/{name}": text for name, text in sidecar_folder().items()})
    files.update(extra or {})
    files.update(train_config(plan))
    return files


def make_run_dir(prepared: Prepared) -> Path:
    """The job's run directory, made if it is not there (private: 0700; scripts can hold paths
    and settings a user may not want others to read, and secrets never go into it at all).
    Every folder above it is checked first, and an existing one must be the user's own 0700
    folder (:mod:`orchestrate.hostside.safeplace`: a labmate must not be able to swap it)."""
    run_dir = Path(prepared.plan.run_dir)
    try:
        safeplace.run_folder(run_dir).close()
    except safeplace.UnsafePlace as exc:
        raise unsafe_error(exc.unsafe, str(prepared.path)) from None
    except OSError as exc:
        raise _unwritable(prepared, exc, run_dir) from None
    return run_dir


def write_run_dir(prepared: Prepared, files: Mapping[str, str]) -> Path:
    """Create the run directory with the backend's ``files``, the plan and what was loaded
    (``plan.json``, ``loaded.json``: what ``resume`` plans again from); returns it. Written
    through the checked folder's descriptor (:func:`orchestrate.hostside.safeplace.write_tree`)."""
    run_dir = Path(prepared.plan.run_dir)
    everything = {**files,
                  PLAN_FILE: json.dumps(prepared.plan.to_json(), indent=2) + "\n",
                  LOADED_FILE: json.dumps(prepared.loaded_json(), indent=2) + "\n"}
    try:
        safeplace.write_tree(run_dir, everything)
    except safeplace.UnsafePlace as exc:
        raise unsafe_error(exc.unsafe, str(prepared.path)) from None
    except OSError as exc:
        raise _unwritable(prepared, exc, run_dir) from None
    return run_dir


def unsafe_error(unsafe: safeplace.Unsafe, source: str, host: str = "") -> UserError:
    """A place another user could swap, as a user error (exit 2) naming the folder, its owner
    and mode, and the fix."""
    where = f"{host}: " if host else ""
    return UserError.single(f"{where}unsafe place for the run directory: {unsafe.message()}",
                            source=source, field="run_root", got=unsafe.folder, hint=unsafe.fix)


def checked_script(prepared: Prepared, run_dir: Path, name: str) -> Path:
    """A script of the run directory, re-checked right before it is run or read by its path:
    every folder above the run directory again, the run directory and its sidecar folder the
    user's own 0700 folders, the script a file of the user's nobody else may write (so what
    ``bash`` or ``sbatch`` opens by this path is what was checked:
    :func:`orchestrate.hostside.safeplace.runnable`). Exit 2 naming the folder otherwise."""
    try:
        return Path(safeplace.runnable(run_dir, name, (SIDECAR_DIR,)))
    except safeplace.UnsafePlace as exc:
        raise unsafe_error(exc.unsafe, str(prepared.path)) from None
    except OSError as exc:
        raise UserError.single(f"cannot run {run_dir / name}: {exc.strerror}",
                               source=str(prepared.path), field="run_root",
                               hint="the run directory changed after it was written") from None


#: The check a machine runs right before a program of the run directory (SSH's
#: ``evidence.py``, Slurm's ``monitor.py``) is run by its path there
#: (:func:`orchestrate.hostside.safeplace.check_main`).
PLACE_CHECK = Manifest("placecheck", (safeplace,))


@lru_cache(maxsize=1)
def place_check_program() -> str:
    """The check's text, for ``python -S -c TEXT RUN_DIR NAME... [FOLDER/...]``."""
    return compact(program(PLACE_CHECK, "from orchestrate.hostside.safeplace import "
                                        "check_main\nsys.exit(check_main(sys.argv[1:]))"))


def place_check(python: str, run_dir: str, *names: str) -> str:
    """The shell words that re-check ``run_dir``'s programs ``names`` (and folders, written
    ``NAME/``) where they run, for ``CHECK && PROGRAM``: a labmate's replacement (a folder
    swapped on the way, a file of his) is refused there, named, and nothing runs."""
    words = (python, "-S", "-c", place_check_program(), run_dir, *names)
    return " ".join(shlex.quote(w) for w in words)


def _unwritable(prepared: Prepared, exc: OSError, run_dir: Path) -> UserError:
    return UserError.single(
        f"cannot write the run directory: {exc.strerror}", source=str(prepared.path),
        field="run_root", got=str(exc.filename or run_dir),
        hint="run directories go under the job's run_root, else $ORCHESTRATE_RUNS, else "
        "./runs: choose a writable place with free space",
    )


def new_record(prepared: Prepared, state: JobState, submitted_at: float) -> JobRecord:
    """The store record of a job about to be launched (with the lease books it uses, so that
    stopping it never needs its files again)."""
    from orchestrate.backends.sharing import lease_books

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
        lease_books=lease_books(prepared),
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

    Secrets reach ranks on standard input (local, SSH), or on Slurm through a 0600 file in the
    run directory that the batch script reads and removes before srun starts (never sbatch's
    environment: slurmctld keeps that on its disk); never a command line or the job's record.
    """
    values = []
    for name in names:
        value = os.environ.get(name)
        if value is None:
            raise UserError.single(
                f"{name} is not set in your environment", source=source, field="secret_env",
                hint=f"export {name}=... before submitting; its value never goes on a command "
                "line or into the job's record",
            )
        if "\n" in value:
            raise UserError.single(f"{name} holds a line break", source=source,
                                   field="secret_env")
        values.append(value)
    return values
