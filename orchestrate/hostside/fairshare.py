"""Fair turns in the lease book: each user's recent use of a machine, decayed, decides whose
waiting job goes next; the admin's policy file beside the book sets the rules.

First come, first served lets a user who queues 30 jobs hold every GPU for days while a
labmate's one job waits behind them. Here a waiting job's place is its owner's *decayed use*
(GPU-seconds, or CPU-slot-seconds for a CPU job, halving every ``half_life_s``, as Slurm's
``PriorityDecayHalfLife``), halved again for every ``age_half_life_s`` the job has waited: the
user who used least goes first, and a job's age raises it without bound (a wait long enough
puts it ahead of every user who has used anything), so nothing waits for ever. Ties go first
come, first served, then by uid and job id: the same order on every host.

**Where use comes from, and why it can be believed.** Every file of the book names its owner's
uid and is believed only when that uid owns it, so nobody can write use *for someone else*:
live leases, and the record of an ended one (``<job>@<uid>.<token>.used``, written by the
supervisor or agent that held the lease as it drops it; charged up to its inode change time at
the latest, the kernel's stamp). But what a user writes about himself he can also rewrite or
delete (the book's folders are ``1777``), and what others write about him they could inflate:
files of users alone cannot keep a user from hiding his own past use. Root's ledger does
(``<book>/<host>.ledger.json``, :func:`fold`, run by root's crontab as ``orchestrate queue
--account``): it only ever adds, and a reader takes the larger of it and the records.

**The policy** is ``policy.json`` beside the host folders of the book
(``/var/tmp/orchestrate/leases/policy.json``): used only when root (or the owner of the book,
on a one-user machine) owns it and nobody else may write it; anything else is named and the
defaults apply. Standard library only, Python 3.8+ (shipped with the SSH agent).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import stat
import time
from dataclasses import dataclass, field

from orchestrate.hostside.bookdir import lstat_or_none, parse_name, read_file
from orchestrate.hostside.host import suppress
from orchestrate.hostside.leaserecord import _int, _object, _time

TYPE_CHECKING = False  # typing costs milliseconds per start; the agent starts once per rank
if TYPE_CHECKING:
    from typing import Any, Dict, Iterable

    from orchestrate.hostside.leaserecord import Lease, Ticket

    Usage = Dict[int, float]

POLICY_FILE = "policy.json"
USED = ".used"
DAY_S = 86400.0
#: Records older than this many half-lives weigh under 0.1%: their owner's next one drops them.
FORGET_HALF_LIVES = 10.0


class QueuePolicyError(ValueError):
    """A policy file field that does not validate: ``field: problem (got value)``."""


@dataclass
class QueuePolicy:
    """The admin's rules for one machine's queue (the defaults when there is no file)."""

    order: str = "fair"  # or "fifo": first come, first served
    half_life_s: float = DAY_S
    age_half_life_s: float = DAY_S  # each this long a job waits halves its owner's use for it
    max_gpus_per_user: int = 0  # 0: no limit
    max_waiting_per_user: int = 0
    source: str = "defaults (no policy file)"
    problem: str = ""  # why a policy file there was not used

    def to_dict(self) -> dict[str, Any]:
        return {"order": self.order, "half_life_s": self.half_life_s,
                "age_half_life_s": self.age_half_life_s,
                "max_gpus_per_user": self.max_gpus_per_user,
                "max_waiting_per_user": self.max_waiting_per_user, "source": self.source,
                "problem": self.problem}


def _number(data: dict[str, Any], name: str, low: float, high: float, whole: bool) -> Any:
    value = data.get(name, getattr(QueuePolicy, name))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (whole and not isinstance(value, int)) or not math.isfinite(value) or \
            not low <= value <= high:
        kind = "a whole number" if whole else "a number"
        raise QueuePolicyError(f"{name}: not {kind} from {low:g} to {high:g} (got {value!r})")
    return value


def parse_policy(text: str | bytes, source: str) -> QueuePolicy:
    """The policy a file holds; :class:`QueuePolicyError` naming the first bad field."""
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise QueuePolicyError("not JSON") from None
    if not isinstance(data, dict):
        raise QueuePolicyError("not a JSON object")
    unknown = sorted(set(data) - (set(QueuePolicy().to_dict()) - {"source", "problem"}))
    if unknown:
        raise QueuePolicyError(f"{unknown[0]}: not a policy field (known: order, "
                               "half_life_s, age_half_life_s, max_gpus_per_user, "
                               "max_waiting_per_user)")
    order = data.get("order", "fair")
    if order not in ("fair", "fifo"):
        raise QueuePolicyError(f"order: not 'fair' or 'fifo' (got {order!r})")
    year = 365 * DAY_S
    return QueuePolicy(
        order=order, half_life_s=float(_number(data, "half_life_s", 60.0, year, False)),
        age_half_life_s=float(_number(data, "age_half_life_s", 60.0, year, False)),
        max_gpus_per_user=_number(data, "max_gpus_per_user", 0, 4096, True),
        max_waiting_per_user=_number(data, "max_waiting_per_user", 0, 1 << 20, True),
        source=source)


def read_policy(root: str) -> QueuePolicy:
    """The policy beside the book's host folders under ``root``; the defaults (``problem``
    saying why) when there is none, or it is not root's (or the book's owner's) alone."""
    path = os.path.join(root, POLICY_FILE)
    data, why, info = read_file(path)
    if info is None and data is None:
        return QueuePolicy()
    folder = lstat_or_none(root)
    owners = {0} | ({folder.st_uid} if folder is not None else set())
    if info is not None and (info.st_uid not in owners or info.st_mode & 0o022):
        return QueuePolicy(problem=f"{path} is ignored: it must belong to root and be "
                           f"writable by nobody else (owner uid {info.st_uid}, mode "
                           f"{stat.S_IMODE(info.st_mode):o}); the defaults apply")
    if data is None:
        return QueuePolicy(problem=f"{path} cannot be read ({why}): the defaults apply")
    try:
        return parse_policy(data, path)
    except QueuePolicyError as exc:
        return QueuePolicy(problem=f"{path}: {exc}: the defaults apply")


@dataclass
class Used:
    """What one ended job held on this host, and when (an ended lease)."""

    job_id: str
    uid: int
    units: int  # GPUs, or CPU slots for a CPU job
    start: float
    end: float
    user: str = ""
    gpus: list[int] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"job_id": self.job_id, "uid": self.uid, "user": self.user,
                           "units": self.units, "gpus": self.gpus, "start": self.start,
                           "end": self.end})

    @classmethod
    def from_json(cls, text: str | bytes, job: str, uid: int) -> Used:
        """The record a file holds (``job`` and ``uid`` from its name); :class:`ValueError`."""
        data = _object(text)
        start, end = _time(data, "start"), _time(data, "end")
        return cls(job_id=job, uid=uid, units=_int(data, "units", 0, 1 << 20, 0),
                   start=min(start, end), end=end)


def decayed(units: float, start: float, end: float, now: float, half_life_s: float) -> float:
    """``units`` held from ``start`` to ``end``, each second weighing ``2**-(age/half_life)``
    at ``now``: the integral, in unit-seconds."""
    if end <= start or units <= 0:
        return 0.0
    rate = math.log(2.0) / half_life_s
    late, early = max(0.0, now - end), max(0.0, now - start)
    return units * (math.exp(-rate * late) - math.exp(-rate * early)) / rate


def lease_units(lease: Lease) -> int:
    return len(lease.gpus) or lease.slots


def ended(directory: str, now: float, half_life_s: float, notes: dict[str, str],
          names: Iterable[str] | None = None) -> list[Used]:
    """The ended jobs' records of the book's host folder that their owners wrote: a file named
    for someone else is named in ``notes`` and ignored; each is charged up to its inode change
    time at the latest (the kernel's, not its writer's)."""
    found = []
    for name in names if names is not None else os.listdir(directory):
        if not name.endswith(USED) or name.startswith("."):
            continue
        parsed = parse_name(name, USED)
        path = os.path.join(directory, name)
        data, why, info = read_file(path)
        if info is None:
            continue
        if parsed is None or info.st_uid != parsed[1]:
            notes.setdefault(path, f"{path} is not named for its owner (uid {info.st_uid}): "
                             "ignored")
            continue
        try:
            record = Used.from_json(data or b"", parsed[0], parsed[1])
        except ValueError as exc:
            notes.setdefault(path, f"{path} is ignored: {why or exc}")
            continue
        record.end = min(record.end, info.st_ctime)
        record.start = min(record.start, record.end)
        found.append(record)
    return found


def usage(leases: list[Lease], records: list[Used], now: float, half_life_s: float) -> Usage:
    """Each user's decayed use, in unit-seconds: live leases (since they were taken) and
    ended records."""
    use: Usage = {}
    for lease in leases:
        if lease.unreadable:
            continue
        start = min(lease.since or now, now)
        use[lease.uid] = use.get(lease.uid, 0.0) + decayed(
            lease_units(lease), start, now, now, half_life_s)
    for record in records:
        use[record.uid] = use.get(record.uid, 0.0) + decayed(
            record.units, record.start, record.end, now, half_life_s)
    return use


def fair_key(ticket: Ticket, use: Usage, policy: QueuePolicy, now: float
             ) -> tuple[float, float, int, str]:
    """A waiting job's place: its owner's decayed use (at least the floor a multi-host job
    carries), halved for every ``age_half_life_s`` the job has waited (a wait long enough
    puts it ahead of any user who has used anything at all); then first come, first served."""
    if policy.order == "fifo":
        return (0.0, ticket.submitted_at, ticket.uid, ticket.job_id)
    mine = max(use.get(ticket.uid, 0.0), floor(ticket, now, policy.half_life_s))
    waited = max(0.0, now - ticket.submitted_at)
    aged = mine * math.exp(-math.log(2.0) * waited / policy.age_half_life_s)
    return (aged, ticket.submitted_at, ticket.uid, ticket.job_id)


def floor(ticket: Ticket, now: float, half_life_s: float) -> float:
    """The use a multi-host job's ticket says its owner has on the busiest of its hosts,
    brought to ``now`` (it can only raise its owner's place, never lower it): decayed, plus
    what the leases held there then (``usage_rate`` units) have added since, so that it is
    that host's own count now while they run, on every host alike -- read at the preflight
    but compared at the claim, a count that grew meanwhile is not stale."""
    if not ticket.usage and not ticket.usage_rate:
        return 0.0
    rate = math.log(2.0) / half_life_s
    kept = math.exp(-rate * max(0.0, now - ticket.usage_at))
    return ticket.usage * kept + ticket.usage_rate * (1.0 - kept) / rate


def growth(book: Any) -> float:
    """How fast this user's use of ``book``'s host grows now: the units its live leases hold
    (after the book's ``live()``)."""
    return float(sum(lease_units(x) for x in book.leases
                     if x.uid == book.uid and not x.unreadable))


def keyer(tickets: list[Ticket], use: Usage, policy: QueuePolicy, now: float) -> Any:
    """The sort key of these tickets' queue: :func:`fair_key`, after every other ticket for a
    user's youngest tickets beyond ``max_waiting_per_user``."""
    late = set()
    if policy.max_waiting_per_user:
        count: dict[int, int] = {}
        for ticket in sorted(tickets, key=lambda t: (t.submitted_at, t.job_id)):
            count[ticket.uid] = count.get(ticket.uid, 0) + 1
            if count[ticket.uid] > policy.max_waiting_per_user:
                late.add((ticket.uid, ticket.job_id))

    # One use per user: the highest floor any of the user's tickets carries. Each ticket's floor
    # was read at its own preflight, so two jobs of one user carried values a rounding apart,
    # and that, not their age, decided which of them went first (CI, stop 42).
    mine = dict(use)
    for ticket in tickets:
        if policy.order != "fifo":
            mine[ticket.uid] = max(mine.get(ticket.uid, 0.0),
                                   floor(ticket, now, policy.half_life_s))

    def key(ticket: Ticket) -> tuple[bool, float, float, int, str]:
        return ((ticket.uid, ticket.job_id) in late, *fair_key(ticket, mine, policy, now))
    return key


def ordered(tickets: list[Ticket], use: Usage, policy: QueuePolicy, now: float) -> list[Ticket]:
    """The queue: who goes first."""
    return sorted(tickets, key=keyer(tickets, use, policy, now))


def why_late(ticket: Ticket, queue: list[Ticket], policy: QueuePolicy) -> str:
    """Why ``ticket`` waits behind every other user's (``max_waiting_per_user``), or ''."""
    limit = policy.max_waiting_per_user
    older = [t for t in queue if t.uid == ticket.uid and
             (t.submitted_at, t.job_id) < (ticket.submitted_at, ticket.job_id)]
    if not limit or len(older) < limit:
        return ""
    return too_many_waiting(ticket.uid, ticket.user or str(ticket.uid), len(older), policy)


def over_limit(uid: int, user: str, gpus: int, leases: list[Lease], policy: QueuePolicy
               ) -> str:
    """Why a claim of ``gpus`` more GPUs by ``uid`` breaks ``max_gpus_per_user`` ('' if not)."""
    if not policy.max_gpus_per_user or not gpus:
        return ""
    holds = sum(len(lease.gpus) for lease in leases if lease.uid == uid)
    if holds + gpus <= policy.max_gpus_per_user:
        return ""
    return (f"policy max_gpus_per_user: {policy.max_gpus_per_user} ({user} holds {holds}, "
            f"this job wants {gpus}; {policy.source})")


def too_many_waiting(uid: int, user: str, waiting: int, policy: QueuePolicy) -> str:
    """Why one more waiting job of ``uid`` breaks ``max_waiting_per_user`` ('' if not)."""
    if not policy.max_waiting_per_user or waiting < policy.max_waiting_per_user:
        return ""
    return (f"policy max_waiting_per_user: {policy.max_waiting_per_user} ({user} has "
            f"{waiting} waiting; {policy.source})")


def spend(book: Any, lease: Lease) -> None:
    """Record what this user's ended ``lease`` held (``book``: the
    :class:`~orchestrate.hostside.leases.LeaseBook`, whose lock is held), under a new name;
    this user's records too old to weigh are dropped."""
    units, now = lease_units(lease), time.time()
    if lease.unreadable or not units or now - (lease.since or now) < 1.0:
        return  # nothing held, or a claim dropped at once (a waiting SSH job's)
    record = Used(lease.job_id, book.uid, units, min(lease.since or now, now), now,
                  lease.user, list(lease.gpus))
    tmp = book._temp(record.to_json().encode())
    name = f"{lease.job_id}@{book.uid}.{secrets.token_hex(8)}{USED}"
    try:
        os.rename(tmp, os.path.join(book.directory, name))
    except OSError:
        with suppress(OSError):
            os.unlink(tmp)
    old = now - FORGET_HALF_LIVES * book.policy.half_life_s
    for other in os.listdir(book.directory):
        if other.endswith(USED) and f"@{book.uid}." in other:
            path = os.path.join(book.directory, other)
            info = lstat_or_none(path)
            if info is not None and info.st_uid == book.uid and info.st_mtime < old:
                with suppress(OSError):
                    os.unlink(path)


def use(book: Any) -> Usage:
    """Each user's decayed use of ``book``'s host (inside its lock): the leases its last
    ``live()`` found and the ended jobs' records, or root's ledger where that says more."""
    cached = getattr(book, "fair_use", None)
    if cached is not None and cached[0] is book.leases:  # the same read of the book
        return dict(cached[1])
    now = time.time()
    half = book.policy.half_life_s
    found = usage(book.leases, ended(book.directory, now, half, book.found), now, half)
    kept = read_ledger(book.directory, book.found)
    for uid, value in kept.get("use", {}).items():
        value *= math.exp(-math.log(2.0) * max(0.0, now - kept["at"]) / half)
        found[int(uid)] = max(found.get(int(uid), 0.0), value)
    book.fair_use = (book.leases, found)
    return dict(found)


def order_key(book: Any, tickets: list[Ticket]) -> Any:
    """:func:`keyer` of ``tickets`` with the users' use of ``book``'s host (inside its lock,
    after its ``live()``), or None where there is nothing to order: one ticket or none. The use
    reads every ended job's record (hundreds after a busy week), which a claim that no one
    waits beside has no need of."""
    if len(tickets) < 2:
        return None
    return keyer(tickets, use(book), book.policy, time.time())


def ledger_path(directory: str) -> str:
    """Root's ledger of a host folder of the book: beside it, where only root writes."""
    return directory.rstrip("/") + ".ledger.json"


def read_ledger(directory: str, notes: dict[str, str]) -> dict[str, Any]:
    """Root's ledger (``{"at", "use": {uid: value}, "counted": {job@uid: until}}``), or {}
    where there is none or it is not root's alone (named in ``notes``)."""
    path = ledger_path(directory)
    data, _, info = read_file(path)
    if info is None or data is None:
        return {}
    if info.st_uid != 0 or info.st_mode & 0o022:
        notes.setdefault(path, f"{path} is ignored: only root's own ledger is believed")
        return {}
    try:
        kept = json.loads(data)
        return {"at": float(kept["at"]), "counted": dict(kept["counted"]),
                "use": {str(int(k)): float(v) for k, v in kept["use"].items()}}
    except (ValueError, KeyError, TypeError, AttributeError):
        notes.setdefault(path, f"{path} is ignored: not a ledger")
        return {}


def fold(book: Any) -> dict[str, Any]:
    """Root's ledger brought up to now (``orchestrate queue --account``, run by root every
    minute): what live leases held since the last fold and the ended records not yet counted
    are added, decayed; nothing is ever taken out, so deleting one's own records later lowers
    nothing. Inside ``book``'s lock, after its ``live()``."""
    now = time.time()
    half = book.policy.half_life_s
    kept = read_ledger(book.directory, book.found) or {"at": now, "use": {}, "counted": {}}
    factor = math.exp(-math.log(2.0) * max(0.0, now - kept["at"]) / half)
    total = {uid: value * factor for uid, value in kept["use"].items()}
    counted: dict[str, float] = {}
    spans = [(f"{x.job_id}@{x.uid}", x.uid, lease_units(x), x.since or now, now)
             for x in book.leases if not x.unreadable]
    spans += [(f"{r.job_id}@{r.uid}", r.uid, r.units, r.start, r.end)
              for r in ended(book.directory, now, half, book.found)]
    for key, uid, units, start, end in spans:
        start = max(start, float(kept["counted"].get(key, start)))
        total[str(uid)] = total.get(str(uid), 0.0) + decayed(units, start, end, now, half)
        counted[key] = max(counted.get(key, 0.0), end, start)
    ledger = {"at": now, "use": total, "counted": counted}
    tmp = book._temp(json.dumps(ledger).encode())
    os.rename(tmp, ledger_path(book.directory))
    return ledger


def rules(book: Any, want: Any, gpus: int) -> list[str]:
    """The admin's limits that hold ``want`` (a ticket, or a claim) back now, each named
    (inside ``book``'s lock, after its ``live()``)."""
    user = book._user(book.uid)
    found = [over_limit(book.uid, user, gpus, book.leases, book.policy)]
    if getattr(want, "submitted_at", None) is not None and hasattr(want, "job_id"):
        found.append(why_late(want, book.tickets(except_job=want.job_id), book.policy))
    return [line for line in found if line]


def shares(use: Usage) -> dict[int, float]:
    """Each user's part of all decayed use (0 to 1)."""
    total = sum(use.values())
    return {uid: (value / total if total else 0.0) for uid, value in use.items()}


__all__ = [
    "POLICY_FILE", "USED", "QueuePolicy", "QueuePolicyError", "Used", "decayed", "ended",
    "fair_key", "floor", "fold", "growth", "keyer", "ledger_path", "order_key", "ordered",
    "over_limit", "parse_policy", "read_ledger", "read_policy", "rules", "shares", "spend",
    "too_many_waiting", "usage", "use", "why_late",
]
