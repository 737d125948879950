"""The lease book's folder: where it is, the permissions that make it safe to share, its
bounded lock, and reading its files without following a link or trusting their size.

The mechanisms :mod:`orchestrate.hostside.leases` builds the book on (its docstring says why
each one is there). Standard library only, Python 3.8+: shipped with the SSH agent and the local
watchdog (:mod:`orchestrate.hostside.shipping`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import time

from orchestrate.hostside.containment import describe_pid, user_name
from orchestrate.hostside.host import suppress

TYPE_CHECKING = False  # typing costs milliseconds per start; the agent starts once per rank
if TYPE_CHECKING:
    from typing import Any

ROOT_VAR = "ORCHESTRATE_LEASES"
DEFAULT_ROOT = "/var/tmp/orchestrate/leases"
LOCK_FILE = ".lock"
LEASE, TICKET = ".json", ".ticket"
#: How long a claim waits for the book's lock before naming whoever holds it.
LOCK_WAIT_S = float(os.environ.get("ORCHESTRATE_LEASE_LOCK_WAIT_S") or 10.0)
MAX_FILE = 1 << 16  # a lease is a few hundred bytes; anything bigger is not one


class BookError(Exception):
    """The lease book cannot be used: what is wrong (``str``) and the fix (``hint``)."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


def book_root(override: str | None = None) -> str:
    """The folder holding every host's book: ``override`` (an inventory node's ``lease_dir``),
    ``$ORCHESTRATE_LEASES``, else :data:`DEFAULT_ROOT`; absolute."""
    root = override or os.environ.get(ROOT_VAR) or DEFAULT_ROOT
    return os.path.abspath(os.path.expanduser(root))


def shared_dir(path: str) -> None:
    """Make ``path`` (and missing parents) ``1777``, or check that the existing one is safe to
    share; :class:`BookError` with the fix otherwise."""
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            continue  # another user made it just now: checked below like any existing one
        except OSError as exc:
            raise BookError(f"cannot create the lease book {folder}: {exc.strerror}",
                            f"point {ROOT_VAR} at a folder you can write") from None
        os.chmod(folder, 0o1777)  # ours, just made: shared with the sticky bit
    check_dir(path)


def check_dir(path: str) -> None:
    """Refuse a lease folder that other users could tamper with, or that this user cannot use."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise BookError(f"cannot use the lease book {path}: {exc.strerror}") from None
    if stat.S_ISLNK(info.st_mode):
        raise BookError(f"the lease book {path} is a symbolic link",
                        f"remove it, or point {ROOT_VAR} at a real folder")
    if not stat.S_ISDIR(info.st_mode):
        raise BookError(f"the lease book {path} is not a folder")
    mode, owner = stat.S_IMODE(info.st_mode), info.st_uid
    mine = owner == os.geteuid()
    sticky = bool(mode & stat.S_ISVTX)
    fix = f"chmod 1777 {path}" if mine else (
        f"ask {user_name(owner)} (or root) to run `chmod 1777 {path}`, or point {ROOT_VAR} "
        "at another folder")
    if mode & 0o022 and not sticky:
        raise BookError(
            f"the lease book {path} is writable by other users but has no sticky bit (mode "
            f"{mode:04o}): anyone could delete or replace another user's leases", fix)
    if not mine and owner != 0 and not sticky:
        raise BookError(f"the lease book {path} belongs to {user_name(owner)} and is not "
                        f"shared (mode {mode:04o})", fix)
    if not os.access(path, os.W_OK | os.X_OK):
        raise BookError(f"the lease book {path} is not writable by you (mode {mode:04o}, owner "
                        f"{user_name(owner)})", fix)


def read_record(path: str) -> tuple[dict[str, Any] | None, str, os.stat_result | None]:
    """A lease or ticket file: its record, or None with why it cannot be read, and its stat."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        return None, exc.strerror or str(exc), lstat_or_none(path)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None, "not a regular file", info
        data = os.read(fd, MAX_FILE + 1)
    except OSError as exc:
        return None, exc.strerror or str(exc), None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE:
        return None, "too big to be a lease", info
    try:
        record = json.loads(data.decode())
        if not isinstance(record, dict):
            raise ValueError("not an object")
        str(record["job_id"])
        [(int(p), s) for p, s in record.get("holders") or []]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return None, f"not a lease ({type(exc).__name__})", info
    return record, "", info


def lstat_or_none(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None



class Locked:
    """An exclusive ``flock`` of the book's lock file, waited for at most ``wait_s``."""

    def __init__(self, path: str, wait_s: float) -> None:
        self.path = path
        self.wait_s = wait_s

    def __enter__(self) -> None:
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW
                              | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise BookError(f"cannot open the lease book's lock {self.path}: {exc.strerror}",
                            "remove it if it is a symbolic link or not a file") from None
        info = os.fstat(self.fd)
        if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != 0o644:
            with suppress(OSError):
                os.fchmod(self.fd, 0o644)  # ours: readable by every user, so each can lock it
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
            if time.monotonic() > deadline:
                os.close(self.fd)
                raise BookError(
                    f"the lease book {os.path.dirname(self.path)} stayed locked for "
                    f"{self.wait_s:g}s by {lock_holder(info)}",
                    "that process holds the lock of every user's leases: ask its owner (or "
                    "root) to stop it") from None
            time.sleep(0.02)

    def __exit__(self, *_: object) -> None:
        with suppress(OSError):
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def lock_holder(info: os.stat_result) -> str:
    """Who holds a ``flock`` of the file ``info`` describes, from ``/proc/locks``."""
    want = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        words = line.split()
        if len(words) > 5 and words[1] == "FLOCK" and words[5] == want:
            pid = int(words[4])
            return describe_pid(pid)
    return "another process (not found in /proc/locks)"



__all__ = [
    "DEFAULT_ROOT", "LOCK_FILE", "LOCK_WAIT_S", "ROOT_VAR", "BookError", "Locked", "book_root",
    "check_dir", "lock_holder", "lstat_or_none", "read_record", "shared_dir",
]
