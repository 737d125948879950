"""What an SSH host says in its preflight and when it claims, as records (review C2).

The agent builds these from what the host-side modules found (:mod:`orchestrate.hostside`'s
dicts: nvidia-smi's GPUs, the lease book's holdings, the interface and name lookups) and sends
``to_json()``; the controller reads them back with ``from_json`` (:mod:`.wire`'s reading: each
field checked by name and kind, a record inside a record field by field), so a reply that does
not fit is one named error, never a ``KeyError`` or a silent ``None`` in the judgement
(:mod:`.preflight`). Standard library only, Python 3.8+: the agent carries this module
(:data:`orchestrate.backends.ssh.channels.AGENT`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrate.backends.ssh.wire import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


@dataclass(frozen=True)
class Workdir(Record):
    """Whether the job's working directory exists on the host."""

    ok: bool
    path: str


@dataclass(frozen=True)
class TorchFact(Record):
    """``import torch`` (and the command's orchestrate module) as the ranks will: the version,
    or what the import said last."""

    ok: bool
    version: str | None = None
    detail: str | None = None


@dataclass(frozen=True)
class Interface(Record):
    """The network interface that carries traffic towards MASTER_ADDR."""

    ok: bool
    name: str | None = None
    ip: str | None = None
    detail: str | None = None


@dataclass(frozen=True)
class Resolved(Record):
    """Whether MASTER_ADDR resolves on the host, and to what."""

    ok: bool
    addresses: list[str] = field(default_factory=list)
    detail: str | None = None


@dataclass(frozen=True)
class GpuList(Record):
    """The GPUs nvidia-smi lists: ``[index, nvidia-smi's name, memory MiB]`` each."""

    ok: bool
    present: list[list[Any]] = field(default_factory=list)
    missing: bool = False  # no nvidia-smi at all
    detail: str | None = None


@dataclass(frozen=True)
class OutsideUse(Record):
    """A GPU in use outside every orchestrate job here (:func:`~orchestrate.hostside.gpuuse.
    outside_use`)."""

    why: str
    free_gb: float | None = None


@dataclass(frozen=True)
class LeaseFacts(Record):
    """What other jobs hold in the host's lease book (:func:`orchestrate.hostside.leases.held`),
    the jobs queued before this one, and the files of the book it could not use
    (``problems``); ``error``: the book itself is unusable (``busy``: its lock stayed held)."""

    gpus: list[int] = field(default_factory=list)
    slots: int = 0
    ports: list[int] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)
    who: dict[str, str] = field(default_factory=dict)  # GPU index -> "job J (user, since)"
    slot_who: str = ""
    unknown: list[str] = field(default_factory=list)  # unreadable leases, honoured
    queue: list[str] = field(default_factory=list)
    use: float = 0.0  # this user's decayed use here (fair share: a multi-host job's order)
    use_rate: float = 0.0  # ... and how fast it grows: the units this user's leases here hold
    problems: list[str] = field(default_factory=list)
    error: str | None = None
    hint: str = ""
    busy: bool = False


@dataclass(frozen=True)
class PortFacts(Record):
    """Which of the candidate master ports can be bound on the host."""

    free: list[int] = field(default_factory=list)
    tried: int = 0


@dataclass(frozen=True)
class HostFacts(Record):
    """The ``preflight`` reply: every fact of the host the controller judges the plan by."""

    hostname: str
    python: str
    workdir: Workdir
    cpus: int | None = None
    interface: Interface | None = None
    master: Resolved | None = None
    gpus: GpuList | None = None
    leases: LeaseFacts = field(default_factory=LeaseFacts)
    gpu_use: dict[str, OutsideUse] = field(default_factory=dict)  # by GPU index
    #: :func:`orchestrate.hostside.gpuhealth.gather`'s answer (judged by the controller)
    gpu_health: dict[str, Any] | None = None
    ports: PortFacts | None = None
    torch: TorchFact | None = None


@dataclass(frozen=True)
class ClaimAnswer(Record):
    """The ``claim`` reply (:meth:`orchestrate.hostside.leases.LeaseBook.claim`): recorded, or
    what the others hold that it wanted."""

    ok: bool
    busy_gpus: list[int] = field(default_factory=list)
    busy_ports: list[int] = field(default_factory=list)
    busy_slots: int = 0
    port_taken: bool = False
    jobs: list[str] = field(default_factory=list)
    who: dict[str, str] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)
    queue: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
