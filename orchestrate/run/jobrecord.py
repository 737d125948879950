"""A job as the store records it: :class:`JobRecord` and its :class:`RankRecord` rows, the
states they are in, and the fields a writer may set.

States are typed (:data:`JobState`, :data:`RankState`), so mypy checks every state a backend or
supervisor writes or compares, and every field it sets (:class:`JobFields`, :class:`RankFields`):
a misspelled state or field fails type checking, not a detached supervisor at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, cast, get_args

from orchestrate.core.plan.outcome import Attempt, Failure
from orchestrate.core.plan.plan import Plan

#: States a job ends in: the local backends' and Slurm's terminal states (a preempted Slurm job
#: that Slurm requeues is shown as REQUEUED, not PREEMPTED).
TerminalState = Literal[
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
    "DEADLINE", "PREEMPTED", "PREEMPTED_FINAL", "REVOKED",
]
#: Every state a job is recorded in. Ours: PENDING (recorded, no rank started yet), RUNNING,
#: RESTARTING (between attempts); on Slurm, SUBMITTING (sbatch did not answer), REQUEUED (waiting
#: to run again) and Slurm's own job states as ``scontrol`` names them (UNKNOWN: a state this
#: version does not know, named in the record's reason).
JobState = Literal[
    TerminalState,
    "PENDING", "RUNNING", "RESTARTING", "SUBMITTING", "REQUEUED",
    "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING", "STAGE_OUT",
    "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "SPECIAL_EXIT", "UNKNOWN",
]
#: A rank's states. STOPPED: the job stopped it itself (after another rank failed, on a cancel,
#: at the time limit): its exit code says how it went, but it did not fail on its own.
RankState = Literal["PENDING", "RUNNING", "COMPLETED", "FAILED", "STOPPED"]

TERMINAL: frozenset[JobState] = frozenset(get_args(TerminalState))
_JOB_STATES: frozenset[str] = frozenset(get_args(JobState))  # nested Literals are flattened
_RANK_STATES: frozenset[str] = frozenset(get_args(RankState))
#: A job between attempts: its last attempt ended, the restart policy starts another.
RESTARTING: JobState = "RESTARTING"
#: The state of a rank the job stopped itself (see :data:`RankState`).
STOPPED: RankState = "STOPPED"
#: The lease book each node of a job leased in, by node name: the folder the inventory's
#: ``lease_dir`` named, or None for the host's default book (:mod:`orchestrate.hostside.leases`).
#: What stops the job releases its lease there without reading the job's files again.
LeaseBooks = dict[str, str | None]


def job_state(text: str) -> JobState:
    """``text`` as a job state: itself when it is one, else UNKNOWN (a newer Slurm's state, or
    a store written by a newer orchestrate)."""
    return cast("JobState", text) if text in _JOB_STATES else "UNKNOWN"


def rank_state(text: str) -> RankState:
    """``text`` as a rank state (a store's column); PENDING for anything else."""
    return cast("RankState", text) if text in _RANK_STATES else "PENDING"


class EndFields(TypedDict, total=False):
    """Job columns a writer may set beside the state and reason (:meth:`Store.finish` sets
    those, and the time it ended): typed, so a misspelled or mistyped field fails mypy, not a
    supervisor at run time."""

    plan: Plan
    external_id: str | None
    supervisor_pid: int | None
    supervisor_host: str | None
    hosts: list[str]
    failure: Failure | None
    started_at: float | None
    first_step_at: float | None
    attempts: list[Attempt]
    diagnosis: dict[str, Any] | None
    lease_books: LeaseBooks | None


class JobFields(EndFields, total=False):
    """Every job column a writer may set (:meth:`Store.update`)."""

    state: JobState
    reason: str
    finished_at: float | None


class RankFields(TypedDict, total=False):
    """The rank columns a writer may set (:meth:`Store.update_rank`)."""

    node: str
    host: str | None
    pid: int | None
    state: RankState
    exit_code: int | None
    signal: int | None
    started_at: float | None
    finished_at: float | None


@dataclass
class RankRecord:
    """What happened to one rank."""

    rank: int
    node: str
    host: str | None = None
    pid: int | None = None
    state: RankState = "PENDING"
    exit_code: int | None = None
    signal: int | None = None
    started_at: float | None = None
    finished_at: float | None = None


@dataclass
class JobRecord:
    """One submitted job."""

    id: str
    name: str
    backend: str
    state: JobState
    run_dir: str
    plan: Plan
    submitted_at: float
    reason: str = ""
    external_id: str | None = None
    supervisor_pid: int | None = None
    supervisor_host: str | None = None
    hosts: list[str] = field(default_factory=list)
    failure: Failure | None = None
    started_at: float | None = None
    first_step_at: float | None = None
    finished_at: float | None = None
    attempts: list[Attempt] = field(default_factory=list)
    diagnosis: dict[str, Any] | None = None
    #: None: not recorded (a backend without lease books, or a job recorded before they were).
    lease_books: LeaseBooks | None = None
    ranks: list[RankRecord] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        """Whether the job has ended."""
        return self.state in TERMINAL

    @property
    def attempt(self) -> int:
        """The number of the current (or last) attempt; 1 for a job never restarted."""
        return self.attempts[-1].n if self.attempts else 1

    def to_json(self) -> dict[str, Any]:
        """The status document (``orchestrate status --json``)."""
        return {
            "id": self.id,
            "name": self.name,
            "backend": self.backend,
            "state": self.state,
            "reason": self.reason,
            "run_dir": self.run_dir,
            "external_id": self.external_id,
            "hosts": self.hosts,
            "failure": None if self.failure is None else self.failure.to_json(),
            "diagnosis": self.diagnosis,
            "world_size": self.plan.world_size,
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "first_step_at": self.first_step_at,
            "finished_at": self.finished_at,
            "attempt": self.attempt,
            "attempts": [a.to_json() for a in self.attempts],
            "ranks": [
                {
                    "rank": r.rank,
                    "node": r.node,
                    "host": r.host,
                    "pid": r.pid,
                    "state": r.state,
                    "exit_code": r.exit_code,
                    "signal": r.signal,
                }
                for r in self.ranks
            ],
        }
