"""What each backend *is*, named once: the facts the planner, the doctor and the CLI decide on.

Code outside :mod:`orchestrate.backends` never compares a backend's name; it asks the
backend's :class:`BackendTraits` (``traits(job.backend).multi_node``). So a new backend is an
entry in :data:`TRAITS`, not a hunt for ``== "slurm"``, and a backend that is another one under
a new name plans exactly as that one does (``tests/core/test_core_backendtraits.py`` holds both).
Pure data, no imports: the spec's own modules (:mod:`orchestrate.core.spec.frameworks`) read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: Which cluster environment the ranks present to frameworks (Lightning): torchrun's variables
#: and ``TORCHELASTIC_RUN_ID``, or Slurm's (``SLURM_*``, set by ``srun``).
SchedulerEnv = Literal["torchelastic", "slurm"]
#: The interpreter of a node whose inventory names none: the one that submitted the job
#: (``sys.executable``: same machine, same virtual environment), or ``python3`` on the PATH.
DefaultPython = Literal["submitter", "python3"]


@dataclass(frozen=True)
class BackendTraits:
    """One backend's capabilities, each a decision some code outside the backend makes."""

    #: Runs a job on more than one node (placement; ``restart.exclude_failed_node``).
    multi_node: bool
    #: A job without ``inventory:`` is refused (else it plans on this machine, probed).
    needs_inventory: bool
    #: See :data:`DefaultPython`.
    default_python: DefaultPython
    #: See :data:`SchedulerEnv` (frameworks' variables, what a container passes in).
    scheduler_env: SchedulerEnv
    #: A scheduler, not the plan, decides which hosts and GPUs the ranks get: the doctor
    #: names no nodes, a container gets the task's GPUs rather than the plan's indices.
    scheduler_allocates: bool
    #: The scheduler sends the job's stop signal ``slurm.signal_seconds_before`` its limit.
    signals_before_limit: bool
    #: Container runtimes that run there, the default first (``container.runtime``).
    container_runtimes: tuple[str, ...]
    #: The runtime of a job that names none, whatever the node has (None: the first of
    #: ``container_runtimes`` the node has).
    container_default: str | None
    #: The backend's own variables every rank's container must be given by name.
    container_env: tuple[str, ...]
    #: Each host keeps its own run directory (no shared file system): a rank's files, such as
    #: its heartbeats, are read on its host.
    files_on_hosts: bool
    #: Leases GPUs, CPU slots and ports in each machine's lease book
    #: (:mod:`orchestrate.hostside.leases`); the job record names the books it used.
    lease_book: bool


#: Every backend's traits, by the name a job's ``backend:`` gives (the ``Backend`` literal of
#: :mod:`orchestrate.core.spec.job`, and ``orchestrate.backends._MODULES``).
TRAITS: dict[str, BackendTraits] = {
    "local": BackendTraits(
        multi_node=False, needs_inventory=False, default_python="submitter",
        scheduler_env="torchelastic", scheduler_allocates=False, signals_before_limit=False,
        container_runtimes=("podman", "docker"), container_default=None, container_env=(),
        files_on_hosts=False, lease_book=True),
    "ssh": BackendTraits(
        multi_node=True, needs_inventory=True, default_python="python3",
        scheduler_env="torchelastic", scheduler_allocates=False, signals_before_limit=False,
        container_runtimes=("podman", "docker"), container_default=None, container_env=(),
        files_on_hosts=True, lease_book=True),
    "slurm": BackendTraits(
        multi_node=True, needs_inventory=True, default_python="python3",
        scheduler_env="slurm", scheduler_allocates=True, signals_before_limit=True,
        container_runtimes=("pyxis", "apptainer", "podman"), container_default="pyxis",
        container_env=("ORCHESTRATE_EXIT_DIR",), files_on_hosts=False, lease_book=False),
}


def traits(backend: str) -> BackendTraits:
    """The traits of the backend called ``backend`` (a job spec admits only those known)."""
    return TRAITS[backend]


__all__ = ["TRAITS", "BackendTraits", "DefaultPython", "SchedulerEnv", "traits"]
