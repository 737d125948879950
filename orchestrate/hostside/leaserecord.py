"""A lease and a queue ticket as typed records: what the lease book's writer writes and every
reader validates, field by field, before it believes a word.

The book is shared by every user of a machine, so its files are written by people, not only by
orchestrate: a labmate may plant ``"gpus": 5``, ``"port": "x"`` or ``"since": 1e300``. One
:class:`Lease` and one :class:`Ticket` (``to_json`` / ``from_json``), used by the writer and by
every reader, turn such a file into a :class:`RecordError` that names the field, never into a
``TypeError`` in the middle of a claim or an overflow when a time is printed. Fields a reader
does not know are ignored (a newer orchestrate may add some); known ones must have their type
and their range. Standard library only, Python 3.8+ (shipped with the SSH agent and the local
watchdog, :mod:`orchestrate.hostside.shipping`).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import dataclass, field

from orchestrate.hostside.containment import describe_pid, live_survivors

TYPE_CHECKING = False  # typing costs milliseconds per start; the agent starts once per rank
if TYPE_CHECKING:
    from typing import Any, List, Mapping, Optional, Tuple, Union

    Holders = List[Tuple[int, Optional[int]]]
    Want = Union["Ticket", Mapping[str, Any]]

#: Times a record may carry (``since``, ``submitted_at``): from 1970 to 2100.
LATEST_TIME = 4102444800.0
MAX_PID = 1 << 22  # Linux's pid_max ceiling
MAX_ITEMS = 4096


class RecordError(ValueError):
    """A lease or ticket file that does not validate: ``field: problem (got value)``."""


def _shown(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bad(name: str, problem: str, value: object) -> RecordError:
    return RecordError(f"{name}: {problem} (got {_shown(value)})")


def _int(data: dict[str, Any], name: str, low: int, high: int, default: int | None = None
         ) -> int:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(name, f"not a whole number from {low} to {high}", value)
    return value


def _text(data: dict[str, Any], name: str, default: str | None = "", limit: int = 4096) -> str:
    value = data.get(name, default)
    if not isinstance(value, str) or len(value) > limit:
        raise _bad(name, "not a short text", value)
    return value


def _time(data: dict[str, Any], name: str) -> float:
    value = data.get(name, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or not 0.0 <= value <= LATEST_TIME:
        raise _bad(name, "not a time (seconds since 1970, before 2100)", value)
    return float(value)


def _amount(data: dict[str, Any], name: str) -> float:
    value = data.get(name, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or not 0.0 <= value <= 1e15:
        raise _bad(name, "not an amount from 0 to 1e15", value)
    return float(value)


def _list(data: dict[str, Any], name: str) -> list[Any]:
    value = data.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_ITEMS:
        raise _bad(name, "not a list", value)
    return value


def _gpus(data: dict[str, Any]) -> list[int]:
    found = _list(data, "gpus")
    if any(isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < MAX_ITEMS
           for g in found):
        raise _bad("gpus", "not a list of GPU indices", found)
    return sorted(set(found))


def _port(data: dict[str, Any]) -> int | None:
    return None if data.get("port") is None else _int(data, "port", 1, 65535)


def _pairs(data: dict[str, Any], name: str) -> Holders:
    """``[[pid, start], ...]``: a process and its start time (None: any)."""
    pairs = []
    for item in _list(data, name):
        if not isinstance(item, list) or len(item) != 2:
            raise _bad(name, "not a list of [pid, start time]", item)
        pid = _int({name: item[0]}, name, 1, MAX_PID)
        start = None if item[1] is None else _int({name: item[1]}, name, 0, 1 << 62)
        pairs.append((pid, start))
    return pairs


def _holders(data: dict[str, Any]) -> Holders:
    pairs = _pairs(data, "holders")
    if not pairs and data.get("holder_pid") is not None:  # a lease of an older orchestrate
        pairs = _pairs({"holder_pid": [[data["holder_pid"], data.get("holder_start")]]},
                       "holder_pid")
    return pairs


def _object(text: str | bytes) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise RecordError(f"not a JSON object (got {_shown(data)})")
    return data


def _job(data: dict[str, Any]) -> str:
    job = _text(data, "job_id", None, 200)
    if not job or "/" in job or "\0" in job:
        raise _bad("job_id", "not a job id", job)
    return job


@dataclass
class Lease:
    """What one job holds on this host, who holds it (``holders``: the processes whose life
    keeps it) and since when. ``unreadable``: set by a reader for a file that did not validate
    (then honoured as holding everything; never written)."""

    job_id: str
    uid: int
    user: str = ""
    node: str = ""
    hostname: str = ""
    gpus: list[int] = field(default_factory=list)
    slots: int = 0
    port: int | None = None
    holders: Holders = field(default_factory=list)
    cgroup: str | None = None
    since: float = 0.0
    left: list[str] = field(default_factory=list)
    survivors: Holders = field(default_factory=list)
    unreadable: str = ""
    until: float = 0.0  # when the job is over at the latest (its time limit); 0: not known

    def to_json(self) -> str:
        first = self.holders[0] if self.holders else (None, None)
        return json.dumps({
            "job_id": self.job_id, "node": self.node, "hostname": self.hostname,
            "user": self.user, "uid": self.uid, "gpus": self.gpus, "slots": self.slots,
            "port": self.port, "holders": [list(p) for p in self.holders],
            # the first holder, as orchestrates before the list read it
            "holder_pid": first[0], "holder_start": first[1], "cgroup": self.cgroup,
            "since": self.since, "left": self.left,
            "survivors": [list(p) for p in self.survivors], "until": self.until})

    def ending(self, within_s: float) -> Lease:
        """This lease, over at the latest ``within_s`` after it was taken (0: not known)."""
        self.until = self.since + within_s if within_s > 0 else 0.0
        return self

    @classmethod
    def from_json(cls, text: str | bytes) -> Lease:
        """The lease a file holds; :class:`RecordError` naming the first bad field."""
        data = _object(text)
        left = _list(data, "left")
        if not all(isinstance(note, str) for note in left):
            raise _bad("left", "not a list of texts", left)
        cgroup = data.get("cgroup")
        if cgroup is not None:
            cgroup = _text(data, "cgroup")
        return cls(job_id=_job(data), uid=_int(data, "uid", 0, 1 << 32, 0),
                   user=_text(data, "user", "", 256), node=_text(data, "node", "", 256),
                   hostname=_text(data, "hostname", "", 256), gpus=_gpus(data),
                   slots=_int(data, "slots", 0, 1 << 20, 0), port=_port(data),
                   holders=_holders(data), cgroup=cgroup, since=_time(data, "since"),
                   left=left, survivors=_pairs(data, "survivors"), until=_time(data, "until"))


@dataclass
class Ticket:
    """A waiting job's place in this host's queue (``submitted_at``: first come, first served)
    and what it may take once placed; held by its ``holders`` (the waiting supervisor or
    agent)."""

    job_id: str
    uid: int
    submitted_at: float
    user: str = ""
    hostname: str = ""
    gpus: list[int] = field(default_factory=list)
    slots: int = 0
    port: int | None = None
    holders: Holders = field(default_factory=list)
    since: float = 0.0
    usage: float = 0.0  # a multi-host job: its owner's use on the busiest of its hosts
    usage_at: float = 0.0  # ... when that was read
    usage_rate: float = 0.0  # ... and how fast it grew then (the units its leases there held)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """The ticket as a JSON object (what the SSH controller sends the agent)."""
        return {"job_id": self.job_id, "user": self.user, "uid": self.uid,
                "hostname": self.hostname, "submitted_at": self.submitted_at,
                "gpus": self.gpus, "slots": self.slots, "port": self.port,
                "holders": [list(p) for p in self.holders], "since": self.since,
                "usage": self.usage, "usage_at": self.usage_at,
                "usage_rate": self.usage_rate}

    @classmethod
    def from_json(cls, text: str | bytes) -> Ticket:
        """The ticket a file holds; :class:`RecordError` naming the first bad field."""
        return cls.from_dict(_object(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ticket:
        return cls(job_id=_job(data), uid=_int(data, "uid", 0, 1 << 32, 0),
                   submitted_at=_time(data, "submitted_at"), user=_text(data, "user", "", 256),
                   hostname=_text(data, "hostname", "", 256), gpus=_gpus(data),
                   slots=_int(data, "slots", 0, 1 << 20, 0), port=_port(data),
                   holders=_holders(data), since=_time(data, "since"),
                   usage=_amount(data, "usage"), usage_at=_time(data, "usage_at"),
                   usage_rate=_amount(data, "usage_rate"))

    def with_holder(self, pid: int, start: int | None) -> Ticket:
        """This ticket held by ``pid`` (the process that waits for it on this host)."""
        return Ticket(self.job_id, os.geteuid(), self.submitted_at, self.user,
                      socket.gethostname(), list(self.gpus), self.slots, self.port,
                      [(pid, start)], time.time(), self.usage, self.usage_at,
                      self.usage_rate)


#: How many bad files one report names before it counts the rest.
REPORT_FIRST = 5


def summary(lines: list[str], where: str = "the lease book", first: int = REPORT_FIRST
            ) -> list[str]:
    """At most ``first`` lines and a count of the rest: 1,000 bad files make six lines."""
    if len(lines) <= first + 1:
        return list(lines)
    return [*lines[:first], f"... and {len(lines) - first} more files of {where} like these"]


def held(leases: list[Lease]) -> dict[str, Any]:
    """What a set of leases holds together: GPUs, CPU slots, ports, by which jobs, and who holds
    each GPU (``who``: index -> "job J (user, since HH:MM:SS)"); ``unknown``: leases that cannot
    be read, honoured as holding everything (a bounded report)."""
    who: dict[str, str] = {}
    for lease in leases:
        for gpu in lease.gpus:
            who[str(gpu)] = describe(lease)
    return {
        "gpus": sorted({g for lease in leases for g in lease.gpus}),
        "slots": sum(lease.slots for lease in leases),
        "ports": sorted({lease.port for lease in leases if lease.port is not None}),
        "jobs": sorted({lease.job_id for lease in leases}),
        "who": who,
        "slot_who": ", ".join(describe(lease) for lease in leases if lease.slots),
        "unknown": summary([lease.unreadable for lease in leases if lease.unreadable]),
    }


def describe(record: Lease | Ticket) -> str:
    """``job J (user, since HH:MM:SS)``: who holds a lease, or waits with a ticket."""
    since = record.since
    when = time.strftime(", since %H:%M:%S", time.localtime(since)) if since else ""
    left = live_survivors([list(p) for p in record.survivors]) \
        if isinstance(record, Lease) else []
    after = ("; it ended, but " + ", ".join(describe_pid(p) for p in left[:3]) +
             " outlived SIGKILL and still run") if left else ""
    return f"job {record.job_id} ({record.user or record.uid}{when}{after})"


def queue_key(ticket: Ticket) -> tuple[float, int, str]:
    """First come, first served: the submit time, then uid and job id (the same on every
    host)."""
    return (ticket.submitted_at, ticket.uid, ticket.job_id)


def wanted(want: Want) -> tuple[tuple[float, int, str], set[int], int, int | None]:
    """A ticket's (or a claim's: no place in the queue, the youngest) place and wants."""
    if isinstance(want, Ticket):
        return queue_key(want), set(want.gpus), want.slots, want.port
    place = (float(want["submitted_at"]), 0, "") if want.get("submitted_at") \
        else (float("inf"), 0, "")
    return (place, {int(g) for g in want.get("gpus") or []}, int(want.get("slots") or 0),
            want.get("port"))


def as_ticket(want: Want) -> Ticket | None:
    """``want`` as a ticket: a ticket, or its JSON object (the SSH preflight's); else None."""
    if isinstance(want, Ticket):
        return want
    if not want.get("job_id") or not want.get("submitted_at"):
        return None
    try:
        return Ticket.from_dict(dict(want))
    except RecordError:
        return None


def conflicts(older: Ticket, want: Want) -> bool:
    """Whether granting ``want`` could take something the ``older`` ticket waits for."""
    _, gpus, slots, port = wanted(want)
    if set(older.gpus) & gpus:
        return True
    if older.slots and slots:
        return True
    return older.port is not None and older.port == port


__all__ = [
    "LATEST_TIME", "Lease", "RecordError", "Ticket", "as_ticket", "conflicts", "describe", "held",
    "queue_key", "summary", "wanted",
]
