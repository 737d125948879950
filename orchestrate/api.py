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
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from orchestrate.job import JobSpec

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

    ``job`` is a job file (``backend: slurm``) or a :class:`~orchestrate.job.JobSpec` whose
    relative paths (inventory, workdir) are relative to the working directory; its ``command``
    or ``train`` section is not used. ``overrides`` are ``--set`` style ``FIELD=VALUE`` strings.
    ``timeout_s`` bounds the whole wait (the job is cancelled then); without it the call still
    returns once Slurm reports the job ended, or forgot it, with or without accounting.

    Raises :class:`~orchestrate.errors.UserError` for a job that cannot be planned,
    ``submitit.core.utils.FailedJobError`` when ``fn`` raised on a rank, and
    :class:`~orchestrate.backends.slurmfn.FunctionJobFailed` when the job ended (failed,
    cancelled, timed out, node failure, forgotten) without a result from every rank.
    """
    from orchestrate.backends.slurmfn import run_function
    from orchestrate.prepare import new_id_suffix, prepare
    from orchestrate.store import Store

    path, temporary = _job_file(job)
    try:
        prepared = prepare(path, tuple(overrides), id_suffix=new_id_suffix())
    finally:
        if temporary:
            path.unlink(missing_ok=True)
    return run_function(prepared, fn, args, kwargs, Store(), timeout_s)


def _job_file(job: str | os.PathLike[str] | JobSpec) -> tuple[Path, bool]:
    """A job file for ``job``: the given path, or a temporary file holding the spec with its
    relative paths resolved against the working directory."""
    if not isinstance(job, JobSpec):
        return Path(job), False
    data = job.model_dump(mode="json", exclude_none=True)
    here = Path.cwd()
    for key in ("inventory", "templates_dir", "run_root"):
        if key in data:
            data[key] = str(here / os.path.expanduser(data[key]))
    data["workdir"] = str(here / os.path.expanduser(data.get("workdir", ".")))
    fd, name = tempfile.mkstemp(prefix=f"orchestrate-{job.name}-", suffix=".yaml")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    return Path(name), True
