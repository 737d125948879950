"""A Python function on every rank of a plan, through submitit, without trusting sacct.

submitit pickles the function, submits a batch script and reads each task's result pickle back.
Two of its defaults do not fit: its own sbatch script (one ``srun`` with Slurm's task layout and
none of the plan's environment), and its state watcher, which polls ``sacct``. Without accounting
sacct fails, the state stays UNKNOWN, and waiting for a job that died before writing its results
never ends. So the executor here submits orchestrate's own job.sbatch (the same template as
``orchestrate submit``; every task runs ``python -m submitit.core._submit`` with the plan's
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ... already set), and the watcher reads
``scontrol show job``, treating a job the controller no longer knows as ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from submitit.core import core, utils
from submitit.slurm import slurm as submitit_slurm

from orchestrate.backends.base import new_record, write_run_dir
from orchestrate.backends.slurm.backend import SlurmBackend
from orchestrate.backends.slurm.ctl import SlurmClient, SlurmError
from orchestrate.core.errors import UserError
from orchestrate.core.layout import SBATCH_SCRIPT, rank_log
from orchestrate.run.logsink import last_lines
from orchestrate.run.prepare import Prepared
from orchestrate.run.store import JobRecord, Store

R = TypeVar("R")

#: The state a job gets once the controller has forgotten it (no accounting to ask).
VANISHED = "VANISHED"
SUBMITIT_DIR = "submitit"
WATCH_INTERVAL_S = 5


class ScontrolWatcher(submitit_slurm.SlurmInfoWatcher):
    """submitit's state watcher, asking ``scontrol show job`` instead of ``sacct``."""

    def __init__(self, delay_s: int = WATCH_INTERVAL_S) -> None:
        super().__init__(delay_s=delay_s)
        self.client = SlurmClient()

    def update(self) -> None:
        """One ``scontrol show job`` per unfinished job; a forgotten job has ended."""
        self._num_calls += 1
        for job_id in sorted(self._registered - self._finished):
            main_id = job_id.split("_")[0]
            try:
                info = self.client.show_job(main_id)
            except SlurmError:
                continue  # the controller may be restarting; ask again next time
            state = VANISHED if info is None else info.get("JobState", "UNKNOWN")
            self._info_dict[job_id] = {"JobID": job_id, "State": state}
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)


class WatchedJob(submitit_slurm.SlurmJob[R]):
    """A submitit Slurm job whose state comes from scontrol."""

    watcher = ScontrolWatcher()


class PlanExecutor(submitit_slurm.SlurmExecutor):
    """Submits orchestrate's rendered job.sbatch instead of submitit's own script."""

    job_class = WatchedJob

    def __init__(self, folder: Path, script: str, world_size: int) -> None:
        super().__init__(folder, max_num_timeout=0)
        self._script = script
        self._world_size = world_size

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self._script

    def _num_tasks(self) -> int:
        return self._world_size


class FunctionJobFailed(RuntimeError):
    """The job ended without a result from every rank: its state, and what the ranks said."""


def function_plan(prepared: Prepared, folder: Path) -> Prepared:
    """The prepared job with every rank running submitit's task runner (the plan's env kept)."""
    plan = prepared.plan
    nodes = tuple(
        replace(n, command=(n.python, "-u", "-m", "submitit.core._submit", str(folder)))
        for n in plan.nodes
    )
    plan = replace(
        plan, nodes=nodes, command=nodes[0].command,
        env={**plan.env, "SUBMITIT_EXECUTOR": "slurm"}, train_config=None,
    )
    return prepared.with_plan(plan)


def run_function(
    prepared: Prepared,
    fn: Callable[..., R],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    store: Store,
    timeout_s: float | None,
) -> list[R]:
    """Submit ``fn(*args, **kwargs)`` on every rank; wait for and return the per-rank results."""
    if prepared.plan.backend != "slurm":
        raise UserError.single(
            "submit_function runs through Slurm", source=str(prepared.path), field="backend",
            got=prepared.plan.backend, hint="set backend: slurm",
        )
    folder = Path(prepared.plan.run_dir) / SUBMITIT_DIR
    prepared = function_plan(prepared, folder)
    files = SlurmBackend().files(prepared.plan, prepared.templates_dir)
    write_run_dir(prepared, files)
    executor = PlanExecutor(folder, files[SBATCH_SCRIPT], prepared.plan.world_size)
    submitted_at = time.time()
    job = executor.submit(fn, *args, **kwargs)
    record = new_record(prepared, "PENDING", submitted_at)
    record.external_id = job.job_id
    record.reason = f"Slurm job {job.job_id}"
    store.add(record)
    return wait_for_results(job, record, store, timeout_s)


def wait_for_results(
    job: core.Job[R], record: JobRecord, store: Store, timeout_s: float | None
) -> list[R]:
    """Every rank's result, or :class:`FunctionJobFailed` naming the job's final state."""
    backend = SlurmBackend()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not job.done():
        if deadline is not None and time.monotonic() > deadline:
            job.cancel(check=False)
            final = backend.cancel(store.get(record.id) or record, store)
            raise FunctionJobFailed(
                f"Slurm job {job.job_id} did not finish within {timeout_s:g}s; cancelled "
                f"({final.state})"
            )
        time.sleep(1.0)
    final = backend.refresh(store.get(record.id) or record, store)
    tasks = range(len(record.ranks))
    missing = [t for t in tasks if not _result_file(job, t).exists()]
    if not missing:
        # Every rank returned something; if some raised, the root cause is the rank that
        # raised first, not the first in task order: the others mostly report the connection
        # it closed. submitit's task runner exits 0 after writing an error, so the order is
        # the order the results were written in.
        for t in sorted(tasks, key=lambda t: _result_file(job, t).stat().st_mtime_ns):
            job.task(t).result()  # a rank that raised: submitit's FailedJobError, its traceback
        return job.results()
    state = job.state if job.state not in ("", "UNKNOWN") else final.state
    if final.terminal:
        state = final.state
    where = Path(record.run_dir)
    rank = final.failure.rank if final.failure is not None else missing[0]
    lines = (final.failure.last_lines if final.failure is not None else []) or last_lines(
        rank_log(where, rank), 10)
    tail = "\n".join(f"  {line}" for line in lines)
    raise FunctionJobFailed(
        f"Slurm job {job.job_id} ended {state} without a result from rank(s) {missing}"
        + (f": {final.reason}" if final.reason else "")
        + (f"\nlast lines of rank {rank}:\n{tail}" if tail else "")
        + f"\nrun dir: {where} (rank output: logs/rank-R.log; merged: orchestrate logs)"
    )


def _result_file(job: core.Job[Any], task: int) -> Path:
    return utils.JobPaths(job.paths.folder, job.job_id, task).result_pickle


__all__ = ["FunctionJobFailed", "PlanExecutor", "ScontrolWatcher", "run_function"]
