"""The SSH agent's protocol as records: one dataclass per request and per reply, shared by the
two ends (review C2).

The controller builds a request record and sends ``to_json()`` as one line; the agent reads it
back with :func:`read_request`, which refuses an unknown op, an unknown or missing field and a
value of the wrong kind with :class:`WireError` (the agent answers it as an ``error`` reply
naming the op and field, and the channel stays usable). A renamed key is then a loud error on
the first run, not a silent ``None`` on a remote host. Every reply is a record too (``ready``,
``pid``, ``exit``, ``ended``, ``foreign``, ``files``, ``queue``, the master reach check's; the
preflight facts and the ``claim`` answer in :mod:`.facts`), read back the same way; a field
holding a record (``workdir: Workdir``, ``gpu_use: dict[str, OutsideUse]``) is read field by
field, and what does not fit is named as ``outer: inner``.

Standard library only, Python 3.8+: the agent carries this module
(:data:`orchestrate.backends.ssh.channels.AGENT`), so both ends run the same text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, TypeVar

    R = TypeVar("R", bound="Record")


class WireError(ValueError):
    """A request or reply that does not match its record."""


#: What a field's annotation (as written) admits, by its outer type's name.
_KINDS = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,),
          "list": (list,), "dict": (dict,)}
#: Every record by class name: a field annotated with one (``Workdir``, ``list[Workdir]``,
#: ``dict[str, Workdir]``) is read with its own :meth:`Record.from_json`, field by field.
RECORDS: dict[str, type[Record]] = {}


def _admits(annotation: str, value: object) -> bool:
    """Whether ``value`` fits ``annotation`` (``str``, ``int | None``, ``list[int]``, ...):
    the outer type only (a record's fields are checked when it is read); ``bool`` is not
    taken for a number."""
    for part in annotation.split(" | "):
        name = part.split("[", 1)[0].strip()
        if name == "None" and value is None:
            return True
        if name == "Any":
            return True
        kinds = (dict,) if name in RECORDS else _KINDS.get(name, ())
        if isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds):
            return True
    return False


def _nested(annotation: str, value: Any) -> Any:
    """``value`` with the records its annotation names read as records (else unchanged)."""
    for part in annotation.split(" | "):
        outer, _, inner = part.strip().partition("[")
        held = RECORDS.get(inner.rstrip("]").split(",")[-1].strip())
        if outer in RECORDS and isinstance(value, dict):
            return RECORDS[outer].from_json(value)
        if held is not None and outer == "list" and isinstance(value, list):
            return [held.from_json(v) for v in value]
        if held is not None and outer == "dict" and isinstance(value, dict):
            return {k: held.from_json(v) for k, v in value.items()}
    return value


class Record:
    """A message: its fields are the JSON object's keys; :attr:`OP` names it on the wire."""

    OP = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        RECORDS[cls.__name__] = cls

    def to_json(self) -> dict[str, Any]:
        """The JSON object (``op`` first for a request)."""
        data: dict[str, Any] = {"op": self.OP} if self.OP else {}
        data.update(dataclasses.asdict(self))  # type: ignore[call-overload]
        return data

    @classmethod
    def from_json(cls: type[R], data: dict[str, Any]) -> R:
        """The record, or :class:`WireError` naming the field that does not fit (a field of a
        record inside it as ``outer: inner``)."""
        what = cls.OP or cls.__name__
        if not isinstance(data, dict):
            raise WireError(f"{what}: not a JSON object")
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - set(fields) - {"op"})
        if unknown:
            raise WireError(f"{what}: unknown field(s) {', '.join(unknown)}")
        values = {}
        for name, spec in fields.items():
            if name not in data:
                if (spec.default is dataclasses.MISSING
                        and spec.default_factory is dataclasses.MISSING):
                    raise WireError(f"{what}: missing field {name}")
                continue
            if not _admits(str(spec.type), data[name]):
                raise WireError(f"{what}: {name} must be {spec.type} "
                                f"(got {type(data[name]).__name__})")
            try:
                values[name] = _nested(str(spec.type), data[name])
            except WireError as exc:
                raise WireError(f"{what}: {name}: {exc}") from None
        return cls(**values)


# ------------------------------------------------------------------------------ requests

@dataclass(frozen=True)
class Preflight(Record):
    """Every check of the host in one go; the reply is the host's facts."""

    OP = "preflight"
    job_id: str
    workdir: str
    python: str
    torch: bool = False  # import torch as the ranks will
    orchestrate: str | None = None  # the orchestrate module the command runs, to import too
    pythonpath: str | None = None
    interface_to: str | None = None  # find the interface towards this address
    master_addr: str | None = None  # must resolve here
    gpus: bool = False  # list the GPUs (nvidia-smi)
    health: bool = False  # the GPUs' health fields and the kernel log's Xid lines
    ports: list[int] = field(default_factory=list)  # master port candidates to bind-test
    lease_dir: str | None = None
    want: dict[str, Any] | None = None  # what the job asks of the host's queue


@dataclass(frozen=True)
class Claim(Record):
    """Record the job's GPUs, slots and port in the host's lease book."""

    OP = "claim"
    job_id: str
    node: str
    gpus: list[int] = field(default_factory=list)
    slots: int = 0
    slot_capacity: int | None = None
    port: int | None = None
    lease_dir: str | None = None
    ticket: dict[str, Any] | None = None
    ends_within_s: float = 0.0  # the job's time limit (and slack): its lease's ``until``


@dataclass(frozen=True)
class Queue(Record):
    """Keep a waiting job's ticket in the host's queue."""

    OP = "queue"
    job_id: str
    ticket: dict[str, Any]
    lease_dir: str | None = None


@dataclass(frozen=True)
class Files(Record):
    """Write the run directory's files (name relative to it -> text)."""

    OP = "files"
    run_dir: str
    files: dict[str, str]


@dataclass(frozen=True)
class Start(Record):
    """Start the rank: ``bash SCRIPT [LOCAL_RANK]``; secrets follow on stdin after ``pid``."""

    OP = "start"
    job_id: str
    script: str
    local_rank: int | None = None  # None: the node's one process (per_node)
    grace_s: float = 5.0
    env: dict[str, str] = field(default_factory=dict)
    lease_dir: str | None = None  # None: the claim's
    watch_s: float | None = None  # look for other users on the job's GPUs this often


@dataclass(frozen=True)
class End(Record):
    """The job is over: stop what the rank left, leave the lease, exit as the rank did."""

    OP = "end"
    grace_s: float | None = None


@dataclass(frozen=True)
class Abort(Record):
    """Nothing was started: release the claim and exit."""

    OP = "abort"


@dataclass(frozen=True)
class Listen(Record):
    """Hold a probe listener on the master port (rank 0's node, during the reach check)."""

    OP = "listen"
    port: int


@dataclass(frozen=True)
class Unlisten(Record):
    """Close the probe listener (before any ``start``)."""

    OP = "unlisten"


@dataclass(frozen=True)
class Reach(Record):
    """Connect to MASTER_ADDR:port and close."""

    OP = "reach"
    master_addr: str
    port: int


@dataclass(frozen=True)
class TrainingProgress(Record):
    """How far training got (the newest checkpoint's step, the last logged step), asked on a
    channel that has not started its rank: no login, shell or interpreter of its own."""

    OP = "progress"
    run_dir: str
    checkpoint_dir: str | None = None


REQUESTS: dict[str, type[Record]] = {cls.OP: cls for cls in (
    Preflight, Claim, Queue, Files, Start, End, Abort, Listen, Unlisten, Reach,
    TrainingProgress)}


def read_request(data: object) -> Record:
    """The request record of one decoded line, or :class:`WireError`."""
    if not isinstance(data, dict):
        raise WireError("a request is a JSON object")
    op = data.get("op")
    kind = REQUESTS.get(op) if isinstance(op, str) else None
    if kind is None:
        raise WireError(f"unknown request {op!r}")
    return kind.from_json(data)


# ------------------------------------------------------------------------------- replies

@dataclass(frozen=True)
class Ready(Record):
    """The agent runs (the pty is raw): its pid and the host's name."""

    pid: int
    hostname: str


@dataclass(frozen=True)
class Pid(Record):
    """The rank's process started."""

    pid: int


@dataclass(frozen=True)
class Exited(Record):
    """How the rank ended (``code`` or ``signal``) and how many processes of the job are left
    on the host."""

    code: int | None = None
    signal: int | None = None
    left: int = 1


@dataclass(frozen=True)
class Ended(Record):
    """What outlived the job's end on the host, named."""

    survivors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ForeignUse(Record):
    """Other users' processes on the job's GPUs here now, said when it changes while the rank
    runs: pid -> "GPU 3 of your job is also used by pid 4242 (ben, python train.py, 12.0 GB)"."""

    uses: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StepAnswer(Record):
    """A step that worked or says why not (``files``, and the master reach check's ``listen``,
    ``unlisten`` and ``reach``: ``via`` the address the master answered at)."""

    ok: bool
    detail: str | None = None
    via: str | None = None
    addresses: list[str] | None = None
    unsafe: dict[str, Any] | None = None  # an unsafe place (safeplace.Unsafe), named
