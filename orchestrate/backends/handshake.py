"""What ``submit`` and a job's detached supervisor say to each other: one line each way.

``submit`` starts the supervisor with pipes on its stdin and stdout, writes one
:class:`Handshake` line (the job as loaded and planned: the supervisor reads no file again) and
waits for one :class:`Verdict` line: launched, or refused with the problems (and, where hosts
were checked, the per-host table). Before it, the supervisor may write progress lines
(``{"progress": phase, "host": host}``: :meth:`VerdictLine.progress`), which ``submit`` shows on
a terminal. Everything the supervisor prints after that goes to its log. After a launch
(or a waiting job's answer) the supervisor keeps its end of the pipe open until the job's end is
recorded (and its report written), then closes it (:meth:`VerdictLine.ended`): ``submit
--follow`` wakes on that end of file instead of finding the end at its next look
(:func:`end_signal`).
Both are typed records with ``to_json``/``from_json``, read and written by the same classes on
both sides.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import IO, TYPE_CHECKING, Any

from orchestrate.backends.hosttable import HostTable
from orchestrate.core.errors import Problem
from orchestrate.core.plan.plan import Plan
from orchestrate.run.loaded import ClaimFacts
from orchestrate.run.progress import show

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; only mypy needs it

    from orchestrate.run.loaded import Loaded


@dataclass(frozen=True)
class Handshake:
    """The job, handed to its supervisor: what was loaded at submit and the plan made from it.

    ``attempt`` is None for a new job, else the attempt ``resume`` starts. ``loaded`` stays JSON
    until :meth:`loaded_job` decodes it: validating it costs (and its models are the slowest
    import), and a supervisor may have better things to do first (the SSH logins; a local
    job's ranks, claimed with ``facts``: :class:`~orchestrate.run.loaded.ClaimFacts`).
    """

    job_id: str
    source: str  # the job file, for messages
    submitted_at: float
    attempt: int | None
    plan: Plan
    loaded: Mapping[str, Any]  # Loaded.to_json()
    facts: ClaimFacts | None = None  # what claiming ``plan`` reads of ``loaded``

    def loaded_job(self) -> Loaded:
        """What was loaded at submit, as a value again."""
        from orchestrate.run.loaded import Loaded

        return Loaded.from_json(dict(self.loaded))

    def to_json(self) -> dict[str, Any]:
        """As JSON values (one line on the supervisor's stdin)."""
        return {"job_id": self.job_id, "source": self.source, "submitted_at": self.submitted_at,
                "attempt": self.attempt, "plan": self.plan.to_json(), "loaded": self.loaded,
                "facts": None if self.facts is None else self.facts.to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        """The inverse of :meth:`to_json` (a subclass reads its own fields beside these)."""
        return cls(**cls.fields_of(data))

    @staticmethod
    def fields_of(data: Mapping[str, Any]) -> dict[str, Any]:
        """This class's fields from ``data``, for a subclass's :meth:`from_json`."""
        attempt, facts = data.get("attempt"), data.get("facts")
        return {"job_id": str(data["job_id"]), "source": str(data["source"]),
                "submitted_at": float(data["submitted_at"]),
                "attempt": None if attempt is None else int(attempt),
                "plan": Plan.from_json(data["plan"]), "loaded": data["loaded"],
                "facts": None if facts is None else ClaimFacts.from_json(facts)}


@dataclass(frozen=True)
class Verdict:
    """The supervisor's answer: launched (``ok``), or refused with the problems, nothing
    launched. ``table``: what was found on each host, when hosts were checked; ``timings``:
    how long the launch steps took (the supervisor's log and ``bench/`` read them);
    ``pending``: accepted, but waiting for what others hold (``submit --wait``)."""

    ok: bool
    problems: tuple[Problem, ...] = ()
    table: HostTable | None = None
    timings: Mapping[str, float] = field(default_factory=dict)
    #: Accepted but waiting (``submit --wait``): what for. The job is recorded PENDING.
    pending: str | None = None

    def to_json(self) -> dict[str, Any]:
        """As JSON values (one line on the supervisor's stdout)."""
        return {"ok": self.ok, "problems": [asdict(p) for p in self.problems],
                "table": None if self.table is None else self.table.to_json(),
                "timings": dict(self.timings), "pending": self.pending}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Verdict:
        """The inverse of :meth:`to_json`."""
        table = data.get("table")
        return cls(ok=bool(data["ok"]),
                   problems=tuple(Problem(**p) for p in data.get("problems", ())),
                   table=None if table is None else HostTable.from_json(table),
                   timings={str(k): float(v) for k, v in (data.get("timings") or {}).items()},
                   pending=None if data.get("pending") is None else str(data["pending"]))


class VerdictLine:
    """The supervisor's end: the one line ``submit`` waits for, on the original stdout.

    Made first thing in the supervisor: it keeps stdout for the verdict and points file
    descriptor 1 at the log (stderr), so nothing else printed can reach ``submit``.
    """

    def __init__(self) -> None:
        self.fd: int | None = os.dup(1)  # not inherited (PEP 446): no rank holds it open
        self.end_fd: int | None = None
        os.dup2(2, 1)

    def progress(self, phase: str, host: str | None = None) -> None:
        """A progress line before the verdict (:class:`orchestrate.run.progress.Progress`):
        ``submit`` shows it on a terminal; after the verdict, nothing. One ``os.write`` of a
        short line: atomic on a pipe, so the SSH fan-out's threads may call it at once."""
        fd = self.fd
        if fd is None:
            return
        with contextlib.suppress(OSError):  # submit is gone: the verdict will say so
            os.write(fd, (json.dumps({"progress": phase, "host": host})[:4000] + "\n").encode())

    def send(self, verdict: Verdict) -> None:
        """Send it (once; later calls do nothing). After a launch the pipe stays open until
        :meth:`ended`: its end of file tells a following ``submit`` that the job's end is
        recorded."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            os.write(fd, (json.dumps(verdict.to_json()) + "\n").encode())
        except OSError:
            os.close(fd)  # submit is gone (Ctrl-C): the record in the store says the rest
            return
        if verdict.ok:
            self.end_fd = fd
        else:
            os.close(fd)

    def ended(self) -> None:
        """The job's end is recorded: close the pipe (its end of file wakes ``submit
        --follow``; the supervisor's exit would close it too, after releasing what the job
        held, which a CLI polling the store did not wait for either)."""
        fd, self.end_fd = self.end_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


#: The supervisors' pipes this process keeps after a launch, by job id: each reaches its end of
#: file once the job's end is recorded (:meth:`VerdictLine.ended`).
_END_SIGNALS: dict[str, IO[bytes]] = {}


def keep_end_signal(job_id: str, stream: IO[bytes]) -> None:
    """Keep the supervisor's pipe of ``job_id`` (after its verdict) for :func:`end_signal`: the
    last one only (a process follows the job it just started; no pipe piles up in one that
    submits many)."""
    for kept in _END_SIGNALS.values():
        with contextlib.suppress(OSError):
            kept.close()
    _END_SIGNALS.clear()
    _END_SIGNALS[job_id] = stream


def end_signal(job_id: str) -> IO[bytes] | None:
    """The pipe whose end of file says that ``job_id``'s end is recorded, when this process
    started its supervisor and kept it (``submit``/``resume --follow``); taken once."""
    return _END_SIGNALS.pop(job_id, None)


def read_verdict(stream: IO[bytes], timeout: float) -> Verdict | None:
    """``submit``'s end: the supervisor's verdict, or None if it ended (or hung for
    ``timeout``) without one. Progress lines before it go to
    :func:`orchestrate.run.progress.show`."""
    deadline = time.monotonic() + timeout
    data = b""
    fd = stream.fileno()
    while True:
        while b"\n" in data:
            line, data = data.split(b"\n", 1)
            message = json.loads(line)
            if "progress" not in message:
                return Verdict.from_json(message)
            show(str(message["progress"]), message.get("host"))
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        data += chunk
