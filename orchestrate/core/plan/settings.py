"""The backend sections of a plan: :class:`SlurmSettings` and :class:`SSHSettings`, typed, and
how a job's spec fills them. Pure.

The defaults live in the job spec (:class:`orchestrate.core.spec.job.SlurmJob`,
:class:`orchestrate.core.spec.job.SSHJob`); these values only carry what the spec and the job's
resources say to the backends, through ``plan.json`` and the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrate.core.spec import hostlist

if TYPE_CHECKING:  # annotations only: planning values need no pydantic import
    from orchestrate.core.spec.job import JobSpec


@dataclass(frozen=True)
class SlurmSettings:
    """The Slurm side of a plan: the job's ``slurm:`` section and the allocation's sizes.

    Values come from the job spec (:class:`orchestrate.core.spec.job.SlurmJob`, which owns the
    defaults) and the job's resources; nothing here has a default of its own.
    """

    partition: str | None
    account: str | None
    qos: str | None
    extra_args: tuple[str, ...]
    signal: str
    signal_seconds_before: int
    gres_type: str | None
    cpus_per_task: int | None
    mem_gb: float | None
    mem: str | None  # --mem as sbatch takes it ("900G", "1536M")
    nodelist: str | None  # the nodes the job names, which Slurm must give it


@dataclass(frozen=True)
class SSHSettings:
    """The SSH side of a plan (from the job's ``ssh:`` section, which owns the defaults)."""

    fanout: int
    connect_timeout_s: float


def slurm_settings(job: JobSpec, chosen: list[str]) -> SlurmSettings:
    s, res = job.slurm, job.resources
    return SlurmSettings(
        partition=s.partition,
        account=s.account,
        qos=s.qos,
        extra_args=tuple(s.extra_args),
        signal=s.signal,
        signal_seconds_before=s.signal_seconds_before,
        gres_type=s.gres_type,
        cpus_per_task=res.cpus_per_task,
        mem_gb=res.mem_gb,
        mem=None if res.mem_gb is None else slurm_memory(res.mem_gb),
        # Nodes the job names are the nodes Slurm must give it.
        nodelist=None if res.node_names is None else hostlist.compress(chosen),
    )


def slurm_memory(gb: float) -> str:
    """``--mem`` as sbatch takes it: a whole number and a unit (``900G``; it refuses ``900.0G``)."""
    return f"{int(gb)}G" if float(gb).is_integer() else f"{max(1, round(gb * 1024))}M"
