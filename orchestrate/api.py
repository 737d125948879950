"""The Python API: run a function on every rank of a job, as ``orchestrate submit`` would.

``submit_function(fn, job, *args)`` plans the job exactly like the CLI (inventory, ranks,
environment), submits it to Slurm through submitit with orchestrate's own job.sbatch, and returns
what ``fn`` returned on each rank, in rank order. Each rank calls ``fn`` with the torchrun
variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) already set, so
``torch.distributed.init_process_group()`` needs no arguments. The job is in the job store too:
``orchestrate status``, ``logs`` and ``cancel`` work on it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from orchestrate.core.spec.job import JobSpec, apply_overrides

R = TypeVar("R")


def submit_function(
    fn: Callable[..., R],
    job: str | os.PathLike[str] | JobSpec,
    *args: Any,
    overrides: Sequence[str] = (),
    timeout_s: float | None = None,
    **kwargs: Any,
) -> list[R]:
    """Run ``fn(*args, **kwargs)`` on every rank of ``job``; return the results by rank.

    ``job`` is a job file (``backend: slurm``) or a :class:`~orchestrate.core.spec.job.JobSpec`
    whose relative paths (inventory, workdir) are relative to the working directory; its ``command``
    or ``train`` section is not used. ``overrides`` are ``--set`` style ``FIELD=VALUE`` strings.
    ``timeout_s`` bounds the whole wait (the job is cancelled then); without it the call still
    returns once Slurm reports the job ended, or forgot it, with or without accounting.

    Raises :class:`~orchestrate.core.errors.UserError` for a job that cannot be planned,
    ``submitit.core.utils.FailedJobError`` with the error of the rank that failed first when
    ``fn`` raised, and :class:`~orchestrate.backends.slurm.function.FunctionJobFailed` when the job
    ended (failed, cancelled, timed out, node failure, forgotten) without a result from every rank.
    """
    from orchestrate.run.extras import require

    require("slurm", "submit_function")
    from orchestrate.backends.slurm.function import run_function
    from orchestrate.run.prepare import load, load_spec, new_id_suffix, plan_job
    from orchestrate.run.store import Store

    if isinstance(job, JobSpec):
        if overrides:
            data = apply_overrides(job.model_dump(mode="json", exclude_unset=True),
                                   tuple(overrides))
            job = JobSpec.model_validate(data)
        loaded = load_spec(job, Path.cwd(), f"<JobSpec {job.name}>", tuple(overrides))
    else:
        loaded = load(Path(job), tuple(overrides))
    prepared = plan_job(loaded, f"{loaded.job.name}-{new_id_suffix()}")
    return run_function(prepared, fn, args, kwargs, Store(), timeout_s)
