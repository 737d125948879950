"""The lease book: what every job on this machine holds, shared by all of its users, and the
queue of jobs waiting for it.

Two jobs on one server must get disjoint GPUs, CPU slots and master ports, whoever submitted
them. So there is **one book per machine**, outside every home: ``$ORCHESTRATE_LEASES`` (else
``/var/tmp/orchestrate/leases``; an inventory node's ``lease_dir`` for SSH hosts), one folder
per host name under it. Standard library only, Python 3.8+: the SSH agent and the local
watchdog carry this module as text (:mod:`orchestrate.hostside.shipping`).

**Who owns what** (:mod:`orchestrate.hostside.bookdir`). The folders are ``1777`` (every user
adds files, only a file's owner removes or replaces it) and must belong to root, who makes them
once (``install -d -o root -g root -m 1777 ...``), or to the user who reads them: a folder's
owner can delete every file in it, so a book whose folders (or the folders above them) another
user owns is refused, with root's one-line fix. The lock is the host's folder itself (``flock``),
which no user can squat, swap or make unreadable. Files are created under unguessable temporary
names (``O_EXCL``, no link followed), renamed to ``<job>@<uid>.json`` (``.ticket``), mode
``0644``; a name someone took first is named with its owner and a second name is used.

**What a reader believes.** Every file is a :class:`~orchestrate.hostside.leaserecord.Lease` or
:class:`~orchestrate.hostside.leaserecord.Ticket` validated field by field. A file whose owner
is not the uid in its name is a forgery (or a squatted name): named and ignored. A lease of its
owner's that cannot be read or does not validate is named and honoured as holding everything
while a process of its owner that started before it was written runs (its owner could hold
every GPU with a valid lease anyway; ignoring it could double-book a job). What a read found
wrong is in :attr:`LeaseBook.problems`, one line per file, bounded (a count after the first few).

**Liveness.** A lease lists its ``holders`` (pid and start time: the local supervisor and its
watchdog, or the SSH agents of the job on the host) and the job's cgroup. It is live while one
of them lives *as a process of the lease's owner* (``pid 1`` holds nothing), or -- for its
owner, and for root -- while a process still carries the job's tag. A stale lease is deleted by
its owner's next reader and ignored by everyone else.

**The queue.** A job that waits (``submit --wait``) writes a ticket naming what it may use; a
claim is refused while a ticket ahead of it wants any of the same GPUs (or CPU slots, or its
port). Ahead is by the owners' decayed use, then age (:mod:`orchestrate.hostside.fairshare`;
the admin's ``policy.json`` may say first come, first served). A ticket counts only while its
holder is a live process of its owner, and its place is never earlier than its holder's start
(less :data:`PLACE_SLACK_S`): a forged ticket cannot jump the queue.
"""

from __future__ import annotations

import os
import secrets
import socket
import stat
import time

from orchestrate.hostside.bookdir import (
    DEFAULT_ROOT,
    LEASE,
    LOCK_FILE,
    LOCK_WAIT_S,
    ROOT_VAR,
    TICKET,
    BookError,
    Locked,
    book_root,
    check_dir,
    lstat_or_none,
    open_book,
    parse_name,
    read_file,
)
from orchestrate.hostside.containment import (
    OldestStarts,
    TagScan,
    alive_cgroup,
    describe_pid,
    owner_uid,
    started_at,
    user_name,
)
from orchestrate.hostside.fairshare import order_key, read_policy, rules, spend
from orchestrate.hostside.gpuuse import foreign_use, holders, usage
from orchestrate.hostside.host import alive, port_free, proc_start, suppress
from orchestrate.hostside.leaserecord import (
    Lease,
    RecordError,
    Ticket,
    as_ticket,
    conflicts,
    describe,
    held,
    queue_key,
    summary,
    wanted,
)

TYPE_CHECKING = False  # typing costs milliseconds per start; the agent starts once per rank
if TYPE_CHECKING:
    from typing import Any, Optional, Tuple, Union

    from orchestrate.hostside.leaserecord import Want

    Record = Union[Lease, Ticket]
    Found = Tuple[str, str, int, Optional[Record], str, os.stat_result]

#: How much earlier than its holder started a ticket may say it was submitted (the SSH agent
#: starts seconds after the submit; a clock a little off): an earlier place is not believed.
PLACE_SLACK_S = float(os.environ.get("ORCHESTRATE_QUEUE_SLACK_S") or 120.0)


def new_lease(job_id: str, node: str, gpus: list[int], slots: int, port: int | None,
              holders: list[int], cgroup: str | None = None) -> Lease:
    """A lease record: what ``job_id`` holds on this host, who holds it, since when."""
    uid = os.geteuid()
    return Lease(job_id=job_id, uid=uid, user=user_name(uid), node=node,
                 hostname=socket.gethostname(), gpus=sorted({int(g) for g in gpus}),
                 slots=int(slots), port=port,
                 holders=[(pid, proc_start(pid)) for pid in holders], cgroup=cgroup,
                 since=time.time())


class LeaseBook:
    """This host's lease files and tickets (see the module docstring). ``problems``: the files
    the last reads ignored or could not read, one line each, its owner and path named."""

    def __init__(self, root: str | None = None, hostname: str | None = None) -> None:
        base = book_root(root)
        self.directory = os.path.join(base, hostname or socket.gethostname())
        self.trust = open_book(base, self.directory)
        self.policy = read_policy(base)
        self.uid = os.geteuid()
        self.leases: list[Lease] = []  # what the last :meth:`live` found
        self.found: dict[str, str] = {}  # path -> what is wrong with it (each named once)
        self._names: dict[int, str] = {}

    @property
    def problems(self) -> list[str]:
        """What the reads since the last lock found wrong with the book, bounded."""
        return summary(list(self.found.values()), self.directory)

    def _note(self, path: str, line: str) -> None:
        self.found.setdefault(path, line)

    def _user(self, uid: int) -> str:
        if uid not in self._names:
            self._names[uid] = user_name(uid)
        return self._names[uid]

    # ---- files -------------------------------------------------------------------------

    def _plain(self, job_id: str, kind: str) -> str:
        return os.path.join(self.directory, f"{job_id}@{self.uid}{kind}")

    def _mine(self, job_id: str, kind: str) -> list[str]:
        """This user's files of ``job_id`` (its usual name first, then second choices)."""
        found = []
        for name in sorted(os.listdir(self.directory)):
            if name.startswith(f"{job_id}@") and parse_name(name, kind) == (job_id, self.uid):
                info = lstat_or_none(os.path.join(self.directory, name))
                if info is not None and info.st_uid == self.uid and stat.S_ISREG(info.st_mode):
                    found.append(os.path.join(self.directory, name))
        plain = self._plain(job_id, kind)
        return sorted(found, key=lambda path: path != plain)

    def locked(self, wait_s: float | None = None) -> Locked:
        """``with book.locked(): ...`` holds the book's exclusive lock (a bounded wait)."""
        self.found = {}
        notes: list[str] = []
        lock = Locked(os.path.join(self.directory, LOCK_FILE),
                      LOCK_WAIT_S if wait_s is None else wait_s, notes)
        self._lock_notes = notes
        return lock

    def _temp(self, data: bytes) -> str:
        """A new file with ``data`` under an unguessable name (``O_EXCL``, no link followed);
        a name someone took first is named with its owner and another is tried."""
        for _ in range(4):
            tmp = os.path.join(self.directory, f".{secrets.token_hex(8)}.tmp")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                self._squatted(tmp)
                continue
            try:
                os.fchmod(fd, 0o644)
                os.write(fd, data)
            finally:
                os.close(fd)
            return tmp
        raise BookError(f"cannot write a file in the lease book {self.directory}: every "
                        "name tried was taken", "; ".join(self.problems))

    def _squatted(self, path: str) -> None:
        info = lstat_or_none(path)
        owner = self._user(info.st_uid) if info is not None else "?"
        self.found[path] = (f"{path} was taken first by {owner}, not by orchestrate: another "
                            "name was used; its owner or root can remove it")

    def _write(self, record: Lease | Ticket, kind: str = LEASE) -> None:
        """Write one of this user's records: a new file renamed over the old one (only its
        owner can replace it: sticky folder); where someone else took the name first, it is
        named with its owner and the record goes under a second, unguessable name."""
        tmp = self._temp(record.to_json().encode())
        mine = self._mine(record.job_id, kind)
        target = mine[0] if mine else self._plain(record.job_id, kind)
        for _ in range(4):
            try:
                os.rename(tmp, target)
                break
            except OSError:
                self._squatted(target)
                target = os.path.join(self.directory, f"{record.job_id}@{self.uid}."
                                      f"{secrets.token_hex(8)}{kind}")
        else:
            with suppress(OSError):
                os.unlink(tmp)
            raise BookError(f"cannot write {target}", "; ".join(self.problems))
        for extra in mine[1:]:
            if extra != target:
                with suppress(OSError):
                    os.unlink(extra)

    def _scan(self, kind: str) -> list[Found]:
        """Every file of ``kind`` that is named for its owner: ``(path, job, uid, record or
        None, why not)``. A file whose owner is not the uid in its name (a forgery, or a name
        squatted before its user wrote it) is named in :attr:`problems` and ignored."""
        found: list[Found] = []
        for name in sorted(os.listdir(self.directory)):
            if name.startswith(".") or not name.endswith(kind):
                continue
            path = os.path.join(self.directory, name)
            parsed = parse_name(name, kind)
            data, why, info = read_file(path)
            if info is None:
                continue  # gone meanwhile
            if parsed is None or info.st_uid != parsed[1]:
                named = f"uid {parsed[1]}" if parsed else "nobody"
                self._note(path, f"{path} belongs to {self._user(info.st_uid)} but is named "
                           f"for {named}: ignored (not a file orchestrate wrote)")
                continue
            record: Lease | Ticket | None = None
            if data is not None:
                try:
                    record = (Lease if kind == LEASE else Ticket).from_json(data)
                except RecordError as exc:
                    why = f"not a valid {'lease' if kind == LEASE else 'ticket'}: {exc}"
            if record is not None:
                record.job_id, record.uid = parsed[0], parsed[1]
                record.user = self._user(parsed[1])
            found.append((path, parsed[0], parsed[1], record, why, info))
        return found

    # ---- reading -----------------------------------------------------------------------

    def live(self, except_job: str | None = None) -> list[Lease]:
        """Leases that still hold something (call inside :meth:`locked`); this user's stale
        ones are deleted. ``except_job``: this user's lease of that job is left out. A lease of
        its owner's that cannot be read comes back with ``unreadable`` set (honoured as holding
        everything while its owner's processes that started before it run)."""
        leases: list[Lease] = []
        scan, oldest = TagScan(), OldestStarts()
        self.found.update({n: n for n in getattr(self, "_lock_notes", [])})
        for path, job, uid, record, why, info in self._scan(LEASE):
            if uid == self.uid and job == except_job:
                continue
            if not isinstance(record, Lease):
                entry = self._unreadable(path, job, uid, why, info, oldest)
                if entry is not None:
                    leases.append(entry)
            elif self._lives(record, uid, scan, path):
                leases.append(record)
            elif uid == self.uid:
                spend(self, record)
                with suppress(OSError):
                    os.unlink(path)
        self.leases = leases
        return leases

    def _held_by(self, pairs: list[tuple[int, int | None]], uid: int, path: str) -> bool:
        """Whether one of ``pairs`` is a live process of ``uid`` (a holder of anyone else's is
        not believed: ``pid 1`` would hold a forged record for ever)."""
        for pid, start in pairs:
            if alive(pid, start):
                if owner_uid(pid) == uid:
                    return True
                self._note(path, f"{path} of {self._user(uid)} names {describe_pid(pid)} as "
                           f"its holder, not a process of {self._user(uid)}: not believed")
        return False

    def _lives(self, record: Lease, uid: int, scan: TagScan, path: str = "") -> bool:
        if self._held_by(list(record.holders), uid, path):
            return True
        if alive_cgroup(record.cgroup):
            return True
        if uid == self.uid or self.uid == 0:  # /proc/*/environ: own processes, or root
            return scan.running(record.job_id, uid)
        return False

    def _unreadable(self, path: str, job: str, uid: int, why: str, info: os.stat_result,
                    oldest: OldestStarts) -> Lease | None:
        """A lease of its owner's that cannot be read or does not validate: honoured while its
        holder may live (a process of its owner that started before it was written); this
        user's own is removed after that."""
        if not oldest.before(uid, info.st_mtime):
            if uid == self.uid:
                with suppress(OSError):
                    os.unlink(path)
            return None
        user = self._user(uid)
        line = (f"{path} of {user} cannot be read ({why}): honoured as holding everything "
                f"while {user}'s processes that started before it run")
        self._note(path, line)
        return Lease(job_id=job, uid=uid, user=user, unreadable=line)

    def tickets(self, except_job: str | None = None) -> list[Ticket]:
        """Live tickets, oldest first; this user's stale ones deleted. A ticket that does not
        validate, or whose holder is not a live process of its owner, is named and ignored (a
        ticket holds a place in the queue, nothing else); one that claims a place before its
        holder started is placed then."""
        found: list[Ticket] = []
        for path, job, uid, record, why, _ in self._scan(TICKET):
            if uid == self.uid and job == except_job:
                continue
            if not isinstance(record, Ticket):
                self._note(path, f"{path} of {self._user(uid)} is ignored: {why}")
                continue
            if self._held_by(list(record.holders), uid, path):
                found.append(self._placed(record, path))
            elif uid == self.uid:
                with suppress(OSError):
                    os.unlink(path)
        return sorted(found, key=order_key(self, found) or queue_key)

    def _placed(self, ticket: Ticket, path: str) -> Ticket:
        starts = [started_at(pid) for pid, _ in ticket.holders]
        first = min((s for s in starts if s is not None), default=None)
        if first is not None and ticket.submitted_at < first - PLACE_SLACK_S:
            self._note(path, f"{path} of {ticket.user} claims a place in the queue from "
                       f"{time.strftime('%H:%M:%S', time.localtime(ticket.submitted_at))}, "
                       "before its holder started: placed at "
                       f"{time.strftime('%H:%M:%S', time.localtime(first))}")
            ticket.submitted_at = first - PLACE_SLACK_S
        return ticket

    def ahead(self, want: Want, job_id: str) -> list[Ticket]:
        """Tickets ahead of ``want`` (a ticket, or a claim with no place in the queue: the
        last) that want any of the same things (call inside :meth:`locked`)."""
        queue, mine, placed = self.tickets(except_job=job_id), wanted(want)[0], as_ticket(want)
        key = order_key(self, [*queue, placed]) if placed else None
        return [t for t in queue if conflicts(t, want) and
                (key(t) < key(placed) if key else queue_key(t) < mine)]

    # ---- writing -----------------------------------------------------------------------

    def record(self, lease: Lease) -> None:
        """Write this user's lease (call inside :meth:`locked`)."""
        self._write(lease)

    def own(self, job_id: str) -> Lease | None:
        """This user's lease of ``job_id``, if readable."""
        for path in self._mine(job_id, LEASE):
            data, _, _ = read_file(path)
            with suppress(RecordError):
                return Lease.from_json(data) if data is not None else None
        return None

    def claim(self, lease: Lease, slot_capacity: int | None = None,
              ticket: Ticket | None = None) -> dict[str, Any]:
        """Record ``lease`` unless another live job holds one of its GPUs or its port, the port
        cannot be bound, the CPU slots would exceed ``slot_capacity``, or an older ticket waits
        for the same things. With ``ticket`` (a waiting job) a refusal keeps it in the queue.
        Returns ``{"ok": True}``, or ``{"ok": False, ...}`` with what the others hold; both
        with ``problems``, the files of the book it ignored or could not read."""
        job_id = lease.job_id
        with self.locked():
            others = held(self.live(except_job=job_id))
            busy_gpus = sorted(set(lease.gpus) & set(others["gpus"]))
            port = lease.port
            port_taken = port is not None and (port in others["ports"] or not port_free(port))
            slots = lease.slots
            too_many = slot_capacity is not None and slots and \
                others["slots"] + slots > slot_capacity
            want = ticket or {"gpus": lease.gpus, "slots": slots, "port": port}
            queue = [describe(t) for t in self.ahead(want, job_id)] + \
                rules(self, want, len(lease.gpus))
            if busy_gpus or port_taken or too_many or others["unknown"] or queue:
                if ticket is not None:
                    self._write(ticket, TICKET)
                return {"ok": False, "busy_gpus": others["gpus"], "busy_ports": others["ports"],
                        "busy_slots": others["slots"], "port_taken": port_taken,
                        "jobs": others["jobs"], "who": others["who"],
                        "unknown": others["unknown"], "queue": queue,
                        "problems": self.problems}
            self._write(lease)
            self._drop(job_id, TICKET)
        return {"ok": True, "problems": self.problems}

    def forget_lease(self, job_id: str) -> None:
        """Drop this user's lease of ``job_id`` (call inside :meth:`locked`)."""
        self._drop(job_id, LEASE)

    def forget(self, job_id: str) -> None:
        """Drop this user's ticket of ``job_id`` (call inside :meth:`locked`)."""
        self._drop(job_id, TICKET)

    def enqueue(self, ticket: Ticket) -> None:
        """Write (or refresh) this user's ticket (call inside :meth:`locked`)."""
        self._write(ticket, TICKET)

    def join(self, job_id: str, pid: int) -> None:
        """Add ``pid`` to the holders of this user's lease of ``job_id`` (a second SSH agent)."""
        with self.locked():
            lease = self.own(job_id)
            if lease is None:
                return
            if not any(p == pid for p, _ in lease.holders):
                lease.holders = [*lease.holders, (pid, proc_start(pid))]
                self._write(lease)

    def leave(self, job_id: str, pids: list[int], survivors: list[int] | None = None,
              notes: list[str] | None = None) -> bool:
        """``pids`` hold the lease no more; ``survivors`` (processes of the job that outlived
        its end) hold it from now on. The lease is dropped once nothing holds it; True if it
        was (or there was none)."""
        with self.locked():
            lease = self.own(job_id)
            if lease is None:
                self._drop(job_id, LEASE)
                return True
            gone = set(pids)
            pairs: list[tuple[int, int | None]] = [
                (p, s) for p, s in lease.holders if p not in gone and alive(p, s)]
            outlived = [(p, proc_start(p)) for p in survivors or [] if proc_start(p) is not None]
            kept = [(p, s) for p, s in lease.survivors if alive(p, s)]
            lease.survivors = [*kept, *(o for o in outlived if o[0] not in dict(kept))]
            pairs += [o for o in outlived if o[0] not in dict(pairs)]
            # The old first holder is written from the list (Lease.to_json): the last holder
            # to leave no longer keeps the lease for older readers.
            lease.holders = pairs
            lease.left = [*lease.left, *(notes or [])]
            if self._lives(lease, self.uid, TagScan()):
                self._write(lease)
                return False
            self._drop(job_id, LEASE)
            return True

    def release(self, job_id: str) -> None:
        """Drop this user's lease and ticket of ``job_id`` (nothing if it has none)."""
        with self.locked():
            self._drop(job_id, LEASE)
            self._drop(job_id, TICKET)

    def settle(self, job_id: str) -> bool:
        """Drop this user's lease of ``job_id`` unless something still holds it (its holders,
        survivors, cgroup or tagged processes); the ticket goes either way. True if dropped."""
        with self.locked():
            self._drop(job_id, TICKET)
            lease = self.own(job_id)
            if lease is not None and self._lives(lease, self.uid, TagScan()):
                return False
            self._drop(job_id, LEASE)
            return True

    def _drop(self, job_id: str, kind: str) -> None:
        """Remove this user's files of ``job_id`` (an ended lease is recorded first)."""
        if kind == LEASE and (lease := self.own(job_id)) is not None:
            spend(self, lease)
        for path in self._mine(job_id, kind):
            with suppress(FileNotFoundError):
                os.unlink(path)


def machine_gpus(lease_dir: str | None) -> dict[str, Any]:
    """This host's GPUs and their holders (``orchestrate gpus``; the SSH agent's answer on a
    host), or why they are unknown; the book's trust state (``book``), the files it ignored or
    could not read and GPUs of jobs that others' processes use too (``problems``, bounded).
    ``lease_dir``: the book's folder (None: its default)."""
    found = usage()
    answer: dict[str, Any] = {"host": socket.gethostname(), "gpus": [], "problems": [],
                              "book": {"path": os.path.join(book_root(lease_dir),
                                                            socket.gethostname()),
                                       "trust": None}}
    leases: list[Lease] = []
    try:
        book = LeaseBook(lease_dir)
        answer["book"] = {"path": book.directory, "trust": book.trust}
        with book.locked():
            leases = book.live()
            queue = book.tickets()
        answer["problems"] += book.problems
        answer["queue"] = [describe(t) for t in queue]
    except (BookError, OSError) as exc:
        hint = getattr(exc, "hint", "")
        answer["book"]["trust"] = f"unusable: {exc}" + (f" ({hint})" if hint else "")
        answer["problems"].append(f"lease book: {exc}" + (f"; fix: {hint}" if hint else ""))
    if not found.get("ok"):
        if not found.get("missing"):
            answer["problems"].append(str(found["detail"]))
        return answer
    answer["problems"] += summary([use["line"] for use in foreign_use(found, leases)],
                                  "GPUs of jobs")
    answer["gpus"] = holders(found, leases)
    return answer

__all__ = ["DEFAULT_ROOT", "ROOT_VAR", "BookError", "Lease", "LeaseBook", "Ticket", "book_root",
           "check_dir", "conflicts", "describe", "held", "machine_gpus", "new_lease", "queue_key"]
