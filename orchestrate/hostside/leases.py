"""The lease book: what every job on this machine holds, shared by all of its users, and the
queue of jobs waiting for it.

Two jobs on one server must get disjoint GPUs, CPU slots and master ports, whoever submitted
them and whichever backend launched them. So there is **one book per machine**, outside every
home: ``$ORCHESTRATE_LEASES`` (else ``/var/tmp/orchestrate/leases``; an inventory node's
``lease_dir`` for SSH hosts), one folder per host name under it (a book on NFS shared by several
machines keeps them apart). Standard library only, Python 3.8+: the SSH agent and the local
watchdog carry this module as text (:mod:`orchestrate.hostside.shipping`).

**Permissions.** The folders are created world-writable with the sticky bit (``1777``, like
``/tmp``): every user may add files, and only a file's owner may remove or replace it. A folder
that is writable by others *without* the sticky bit, or that belongs to another user and is not
shared, is refused with the fix; this module never changes the mode of a folder it did not just
create. Files are created exclusively (``O_EXCL``), never through a symbolic link
(``O_NOFOLLOW``), readable by everyone (who holds which GPU is no secret on a shared box) and
named after their job *and their owner's uid* (``<job>@<uid>.json``), so no user can squat,
overwrite or delete another's lease.

**Locking.** Every change happens under an exclusive ``flock`` of ``.lock``. Any user can open
that file, so any user could hold the lock for ever: a waiter gives up after
``LOCK_WAIT_S`` (:mod:`orchestrate.hostside.bookdir`) and names the holder (user and pid, from
``/proc/locks``).

**Liveness.** A lease lists its ``holders`` (pid and start time: the local supervisor and its
watchdog, or the SSH agents of the job on the host; later the processes that survived the job's
end) and the job's cgroup, if one was made. It is live while one of them lives (``/proc/PID/stat``
and ``cgroup.procs`` are readable by every user), or -- for its owner, and for root, who can read
other users' environments -- while a process still carries the job's tag. A lease that is not
live is stale: its owner's next reader deletes it, anyone else ignores it. A lease that cannot be
read or parsed is reported with its owner and honoured as holding everything until its holder is
gone (no process of its owner that started before the file was written still runs); it is never
deleted by another user.

**The queue.** A job that waits for what others hold (``submit --wait``) writes a ticket
(``<job>@<uid>.ticket``) naming what it may use; a claim is refused while an older live ticket
wants any of the same GPUs (or CPU slots, or its port). Older means submitted earlier (the submit
time, then uid and job id: the same order on every host of a multi-host job), so waiting jobs
start first come, first served across all users, and a big request is never overtaken for ever
by small ones.
"""

from __future__ import annotations

import json
import os
import socket
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
    read_record,
    shared_dir,
)
from orchestrate.hostside.containment import (
    alive_cgroup,
    describe_pid,
    live_survivors,
    owner_uid,
    started_before,
    user_name,
)
from orchestrate.hostside.gpuuse import holders, usage
from orchestrate.hostside.host import alive, port_free, proc_start, suppress, tagged

TYPE_CHECKING = False  # typing costs milliseconds per start; the agent starts once per rank
if TYPE_CHECKING:
    from typing import Any


def holders_of(record: dict[str, Any]) -> list[tuple[int, int | None]]:
    """The processes whose life holds a record: ``[(pid, start), ...]``."""
    found = [(int(p), None if s is None else int(s)) for p, s in record.get("holders") or []]
    if not found and record.get("holder_pid") is not None:  # a lease of an older orchestrate
        start = record.get("holder_start")
        found = [(int(record["holder_pid"]), None if start is None else int(start))]
    return found


def new_lease(job_id: str, node: str, gpus: list[int], slots: int, port: int | None,
              holders: list[int], cgroup: str | None = None) -> dict[str, Any]:
    """A lease record: what ``job_id`` holds on this host, who holds it, since when."""
    uid = os.geteuid()
    pairs = [[pid, proc_start(pid)] for pid in holders]
    return {
        "job_id": job_id, "node": node, "hostname": socket.gethostname(),
        "user": user_name(uid), "uid": uid,
        "gpus": sorted({int(g) for g in gpus}), "slots": int(slots), "port": port,
        "holders": pairs, "holder_pid": holders[0] if holders else None,
        "holder_start": pairs[0][1] if pairs else None, "cgroup": cgroup,
        "since": time.time(), "left": [],
    }


def held(leases: list[dict[str, Any]]) -> dict[str, Any]:
    """What a set of leases holds together: GPUs, CPU slots, ports, by which jobs, and who holds
    each GPU (``who``: index -> "job J (user, since HH:MM:SS)"); ``unknown``: leases that cannot
    be read, honoured as holding everything."""
    who: dict[str, str] = {}
    for lease in leases:
        for gpu in lease.get("gpus") or []:
            who[str(int(gpu))] = describe(lease)
    return {
        "gpus": sorted({int(g) for lease in leases for g in lease.get("gpus") or []}),
        "slots": sum(int(lease.get("slots") or 0) for lease in leases),
        "ports": sorted({int(lease["port"]) for lease in leases if lease.get("port") is not None}),
        "jobs": sorted({str(lease["job_id"]) for lease in leases}),
        "who": who,
        "slot_who": ", ".join(describe(lease) for lease in leases if lease.get("slots")),
        "unknown": [lease["unreadable"] for lease in leases if lease.get("unreadable")],
    }


def describe(record: dict[str, Any]) -> str:
    """``job J (user, since HH:MM:SS)``: who holds a lease, or waits with a ticket."""
    since = record.get("since") or record.get("created")
    when = time.strftime(", since %H:%M:%S", time.localtime(float(since))) if since else ""
    left = live_survivors(record.get("survivors"))
    after = ("; it ended, but " + ", ".join(describe_pid(p) for p in left[:3]) +
             " outlived SIGKILL and still run") if left else ""
    return (f"job {record.get('job_id')} ({record.get('user') or record.get('uid', '?')}"
            f"{when}{after})")



def queue_key(ticket: dict[str, Any]) -> tuple[float, int, str]:
    """First come, first served: the submit time, then uid and job id (the same on every
    host)."""
    return (float(ticket.get("submitted_at") or 0.0), int(ticket.get("uid") or 0),
            str(ticket.get("job_id")))


def conflicts(older: dict[str, Any], want: dict[str, Any]) -> bool:
    """Whether granting ``want`` could take something the ``older`` ticket waits for."""
    if set(older.get("gpus") or []) & set(want.get("gpus") or []):
        return True
    if older.get("slots") and want.get("slots"):
        return True
    return older.get("port") is not None and older.get("port") == want.get("port")


class LeaseBook:
    """This host's lease files and tickets (see the module docstring)."""

    def __init__(self, root: str | None = None, hostname: str | None = None) -> None:
        base = book_root(root)
        shared_dir(base)
        self.directory = os.path.join(base, hostname or socket.gethostname())
        shared_dir(self.directory)
        self.uid = os.geteuid()

    # ---- files -------------------------------------------------------------------------

    def _path(self, job_id: str, kind: str = LEASE, uid: int | None = None) -> str:
        return os.path.join(self.directory, f"{job_id}@{self.uid if uid is None else uid}{kind}")

    def locked(self, wait_s: float | None = None) -> Locked:
        """``with book.locked(): ...`` holds the book's exclusive lock (a bounded wait)."""
        return Locked(os.path.join(self.directory, LOCK_FILE),
                      LOCK_WAIT_S if wait_s is None else wait_s)

    def _write(self, record: dict[str, Any], kind: str = LEASE) -> None:
        """Write one of this user's records: a new file (``O_EXCL``, no symlink followed),
        renamed over the old one; only its owner can replace it (sticky folder)."""
        path = self._path(str(record["job_id"]), kind)
        tmp = os.path.join(self.directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.fchmod(fd, 0o644)
            os.write(fd, json.dumps(record).encode())
        finally:
            os.close(fd)
        try:
            os.rename(tmp, path)
        except OSError as exc:
            with suppress(OSError):
                os.unlink(tmp)
            info = lstat_or_none(path)
            squatter = user_name(info.st_uid) if info is not None else "?"
            raise BookError(f"cannot write {path}: {exc.strerror} (the file there belongs to "
                            f"{squatter})", "remove it, or ask its owner or root to") from None

    def _records(self, kind: str) -> list[tuple[str, dict[str, Any] | None, str,
                                                os.stat_result | None]]:
        found = []
        for name in sorted(os.listdir(self.directory)):
            if name.endswith(kind) and not name.startswith("."):
                path = os.path.join(self.directory, name)
                record, why, info = read_record(path)
                found.append((path, record, why, info))
        return found

    # ---- reading -----------------------------------------------------------------------

    def live(self, except_job: str | None = None) -> list[dict[str, Any]]:
        """Leases that still hold something (call inside :meth:`locked`); this user's stale
        ones are deleted. ``except_job``: this user's lease of that job is left out. A lease
        that cannot be read comes back as ``{"job_id", "uid", "user", "unreadable": why}``."""
        leases, scan = [], _TagScan()
        for path, record, why, info in self._records(LEASE):
            uid = info.st_uid if info is not None else -1
            if record is None:
                entry = self._unreadable(path, why, info)
                if entry is not None:
                    leases.append(entry)
                continue
            if uid == self.uid and str(record["job_id"]) == except_job:
                continue
            record["uid"] = uid  # the file's owner, whatever the record claims
            record.setdefault("user", user_name(uid))
            if self._lives(record, uid, scan):
                leases.append(record)
            elif uid == self.uid:
                with suppress(OSError):
                    os.unlink(path)
        return leases

    def _lives(self, record: dict[str, Any], uid: int, scan: _TagScan) -> bool:
        if any(alive(int(pid), start) for pid, start in holders_of(record)):
            return True
        if alive_cgroup(record.get("cgroup")):
            return True
        if uid == self.uid or self.uid == 0:  # /proc/*/environ: own processes, or root
            return scan.running(str(record["job_id"]), uid)
        return False

    def _unreadable(self, path: str, why: str, info: os.stat_result | None
                    ) -> dict[str, Any] | None:
        """A lease that cannot be read: honoured while its holder may live (a process of its
        owner that started before it was written); this user's own is removed after that."""
        if info is None:
            return None  # gone meanwhile
        name = os.path.basename(path)
        job = name[:-len(LEASE)].rsplit("@", 1)[0]
        if not started_before(info.st_uid, info.st_mtime):
            if info.st_uid == self.uid:
                with suppress(OSError):
                    os.unlink(path)
            return None
        user = user_name(info.st_uid)
        return {"job_id": job, "uid": info.st_uid, "user": user, "gpus": [], "slots": 0,
                "port": None, "unreadable": f"{path} of {user} cannot be read ({why}): honoured "
                f"as holding everything while {user}'s processes that started before it run"}

    def tickets(self, except_job: str | None = None) -> list[dict[str, Any]]:
        """Live tickets, oldest first; this user's stale ones deleted, unreadable ones ignored
        (a ticket holds a place in the queue, nothing else)."""
        found = []
        for path, record, _, info in self._records(TICKET):
            if record is None or info is None:
                continue
            uid = info.st_uid
            if uid == self.uid and str(record["job_id"]) == except_job:
                continue
            record["uid"] = uid
            record.setdefault("user", user_name(uid))
            if any(alive(int(pid), start) for pid, start in holders_of(record)):
                found.append(record)
            elif uid == self.uid:
                with suppress(OSError):
                    os.unlink(path)
        return sorted(found, key=queue_key)

    def ahead(self, want: dict[str, Any], job_id: str) -> list[dict[str, Any]]:
        """Tickets older than ``want`` (a ticket, or a claim with no place in the queue: the
        youngest) that want any of the same things (call inside :meth:`locked`)."""
        mine = queue_key(want) if want.get("submitted_at") else (float("inf"), 0, "")
        return [t for t in self.tickets(except_job=job_id)
                if queue_key(t) < mine and conflicts(t, want)]

    # ---- writing -----------------------------------------------------------------------

    def record(self, lease: dict[str, Any]) -> None:
        """Write this user's lease (call inside :meth:`locked`)."""
        self._write(lease)

    def own(self, job_id: str, kind: str = LEASE) -> dict[str, Any] | None:
        """This user's record of ``job_id`` (lease or ticket), if readable."""
        record, _, _ = read_record(self._path(job_id, kind))
        return record

    def claim(self, lease: dict[str, Any], slot_capacity: int | None = None,
              ticket: dict[str, Any] | None = None) -> dict[str, Any]:
        """Record ``lease`` unless another live job holds one of its GPUs or its port, the port
        cannot be bound, the CPU slots would exceed ``slot_capacity``, or an older ticket waits
        for the same things. With ``ticket`` (a waiting job) a refusal keeps it in the queue.
        Returns ``{"ok": True}``, or ``{"ok": False, ...}`` with what the others hold."""
        job_id = str(lease["job_id"])
        with self.locked():
            others = held(self.live(except_job=job_id))
            busy_gpus = sorted(set(lease.get("gpus") or []) & set(others["gpus"]))
            port = lease.get("port")
            port_taken = port is not None and (port in others["ports"] or not port_free(port))
            slots = int(lease.get("slots") or 0)
            too_many = slot_capacity is not None and slots and \
                others["slots"] + slots > slot_capacity
            want = ticket or {"gpus": lease.get("gpus"), "slots": slots, "port": port}
            queue = [describe(t) for t in self.ahead(want, job_id)]
            if busy_gpus or port_taken or too_many or others["unknown"] or queue:
                if ticket is not None:
                    self._write(ticket, TICKET)
                return {"ok": False, "busy_gpus": others["gpus"], "busy_ports": others["ports"],
                        "busy_slots": others["slots"], "port_taken": port_taken,
                        "jobs": others["jobs"], "who": others["who"],
                        "unknown": others["unknown"], "queue": queue}
            self._write(lease)
            self._drop(job_id, TICKET)
        return {"ok": True}

    def forget_lease(self, job_id: str) -> None:
        """Drop this user's lease of ``job_id`` (call inside :meth:`locked`)."""
        self._drop(job_id, LEASE)

    def forget(self, job_id: str) -> None:
        """Drop this user's ticket of ``job_id`` (call inside :meth:`locked`)."""
        self._drop(job_id, TICKET)

    def enqueue(self, ticket: dict[str, Any]) -> None:
        """Write (or refresh) this user's ticket (call inside :meth:`locked`)."""
        self._write(ticket, TICKET)

    def join(self, job_id: str, pid: int) -> None:
        """Add ``pid`` to the holders of this user's lease of ``job_id`` (a second SSH agent)."""
        with self.locked():
            lease = self.own(job_id)
            if lease is None:
                return
            pairs = holders_of(lease)
            if not any(p == pid for p, _ in pairs):
                lease["holders"] = [*pairs, (pid, proc_start(pid))]
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
                (p, s) for p, s in holders_of(lease) if p not in gone and alive(p, s)]
            outlived = [(p, proc_start(p)) for p in survivors or [] if proc_start(p) is not None]
            kept = [(p, s) for p, s in lease.get("survivors") or [] if alive(int(p), s)]
            lease["survivors"] = [*kept, *(o for o in outlived if o[0] not in dict(kept))]
            pairs += [o for o in outlived if o[0] not in dict(pairs)]
            lease["holders"] = pairs
            # The first holder, kept for older orchestrates' readers, goes with the others:
            # holders_of falls back to it when the list is empty, so the last holder to leave
            # would keep the lease (an SSH agent: a stale lease left behind on the host).
            lease["holder_pid"], lease["holder_start"] = pairs[0] if pairs else (None, None)
            lease["left"] = [*(lease.get("left") or []), *(notes or [])]
            if self._lives(lease, self.uid, _TagScan()):
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
            if lease is not None and self._lives(lease, self.uid, _TagScan()):
                return False
            self._drop(job_id, LEASE)
            return True

    def _drop(self, job_id: str, kind: str) -> None:
        with suppress(FileNotFoundError):
            os.unlink(self._path(job_id, kind))


class _TagScan:
    """One scan of ``/proc/*/environ`` for job tags, made the first time it is needed."""

    def __init__(self) -> None:
        self.found: dict[str, list[int]] | None = None

    def running(self, job_id: str, uid: int) -> bool:
        if self.found is None:
            self.found = tagged()
        return any(owner_uid(pid) == uid for pid in self.found.get(job_id, []))


__all__ = [
    "DEFAULT_ROOT", "ROOT_VAR", "BookError", "LeaseBook", "book_root", "check_dir",
    "conflicts", "describe", "held", "holders_of", "new_lease", "queue_key", "shared_dir",
]


def machine_gpus(lease_dir: str | None) -> dict[str, Any]:
    """This host's GPUs and their holders (``orchestrate gpus``; the SSH agent's answer on a
    host), or why they are unknown. ``lease_dir``: the book's folder (None: its default)."""
    found = usage()
    answer: dict[str, Any] = {"host": socket.gethostname(), "gpus": [], "problems": []}
    if not found.get("ok"):
        if not found.get("missing"):
            answer["problems"].append(str(found["detail"]))
        return answer
    leases: list[dict[str, Any]] = []
    try:
        book = LeaseBook(lease_dir)
        with book.locked():
            leases = book.live()
    except (BookError, OSError) as exc:
        answer["problems"].append(f"lease book: {exc}")
    answer["problems"] += [str(lease["unreadable"]) for lease in leases
                           if lease.get("unreadable")]
    answer["gpus"] = holders(found, leases)
    return answer
