"""What every backend does: submit a prepared job, report its state, cancel it.

``submit`` returns once the job is launched (or queued); watching it is the job store's and the
log's business, so ``--follow``, ``status``, ``logs`` and ``cancel`` work the same on every
backend.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from orchestrate.layout import PLAN_FILE
from orchestrate.store import JobRecord, RankRecord, Store

if TYPE_CHECKING:
    from orchestrate.prepare import Prepared


class Backend(Protocol):
    """A way of running jobs."""

    name: str

    def submit(self, prepared: Prepared, store: Store) -> JobRecord:
        """Launch (or queue) the job and record it; returns without waiting for it."""

    def refresh(self, job: JobRecord, store: Store) -> JobRecord:
        """Bring the job's recorded state up to date (e.g. a supervisor that vanished)."""

    def cancel(self, job: JobRecord, store: Store) -> JobRecord:
        """Stop every process of the job; returns the record once it is stopped."""


def write_run_dir(prepared: Prepared) -> Path:
    """Create the run directory with the rendered files and the plan; returns it.

    The directory is private (0700): scripts can hold paths and settings a user may not want
    others to read, and secrets never go into it at all.
    """
    run_dir = Path(prepared.plan.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name, text in prepared.files.items():
        target = run_dir / name
        target.write_text(text, encoding="utf-8")
        if name.endswith((".sh", ".sbatch")):
            target.chmod(0o700)
    (run_dir / PLAN_FILE).write_text(json.dumps(prepared.plan.to_json(), indent=2) + "\n")
    return run_dir


def new_record(prepared: Prepared, state: str, submitted_at: float) -> JobRecord:
    """The store record of a job about to be launched."""
    plan = prepared.plan
    return JobRecord(
        id=plan.job_id,
        name=plan.job_name,
        backend=plan.backend,
        state=state,
        run_dir=plan.run_dir,
        plan=plan.to_json(),
        submitted_at=submitted_at,
        hosts=[n.address for n in plan.nodes],
        ranks=[RankRecord(rank=r.rank, node=r.node) for r in plan.ranks],
    )
