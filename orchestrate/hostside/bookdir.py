"""The lease book's folder: where it is, who must own it and the folders above it, its bounded
lock (the folder itself), and reading its files without following a link or trusting their
size.

The mechanisms :mod:`orchestrate.hostside.leases` builds the book on (its docstring says why
each one is there). A folder's owner can delete every file in it, sticky bit or not, so only
root (or the one user who reads it) may own the book's folders; root makes them once with the
line :func:`root_fix` prints. Standard library only, Python 3.8+: shipped with the SSH agent and
the local watchdog (:mod:`orchestrate.hostside.shipping`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import time

from orchestrate.hostside.containment import describe_pid, user_name
from orchestrate.hostside.host import suppress

TYPE_CHECKING = False  # typing costs milliseconds per start; the agent starts once per rank
if TYPE_CHECKING:
    pass

ROOT_VAR = "ORCHESTRATE_LEASES"
DEFAULT_ROOT = "/var/tmp/orchestrate/leases"
LOCK_FILE = ".lock"
LEASE, TICKET = ".json", ".ticket"
#: How long a claim waits for the book's lock before naming whoever holds it.
LOCK_WAIT_S = float(os.environ.get("ORCHESTRATE_LEASE_LOCK_WAIT_S") or 10.0)
MAX_FILE = 1 << 16  # a lease is a few hundred bytes; anything bigger is not one


_TOKEN = re.compile(r"^[0-9a-f]{16}$")


def parse_name(name: str, kind: str) -> tuple[str, int] | None:
    """``<job>@<uid><kind>`` or ``<job>@<uid>.<token><kind>`` (a name taken by someone else:
    the owner's second choice) -> ``(job, uid)``; None for any other name."""
    if not name.endswith(kind) or name.startswith("."):
        return None
    job, at, rest = name[:-len(kind)].rpartition("@")
    uid, _, token = rest.partition(".")
    if not at or not job or not uid.isdigit() or (token and not _TOKEN.match(token)):
        return None
    return job, int(uid)


class BookError(Exception):
    """The lease book cannot be used: what is wrong (``str``) and the fix (``hint``).
    ``busy``: its lock stayed held (try again later); else the machine's setup is wrong (not
    the user's mistake: :data:`orchestrate.core.exits.EXIT_SETUP`)."""

    def __init__(self, message: str, hint: str = "", busy: bool = False) -> None:
        super().__init__(message)
        self.hint = hint
        self.busy = busy


def book_root(override: str | None = None) -> str:
    """The folder holding every host's book: ``override`` (an inventory node's ``lease_dir``),
    ``$ORCHESTRATE_LEASES``, else :data:`DEFAULT_ROOT`; absolute."""
    root = override or os.environ.get(ROOT_VAR) or DEFAULT_ROOT
    return os.path.abspath(os.path.expanduser(root))


def root_fix(folders: list[str]) -> str:
    """The one line root runs once to make (or take back) the book's folders."""
    return "as root, once: install -d -o root -g root -m 1777 " + " ".join(folders)


def open_book(base: str, directory: str) -> str:
    """Make the book's missing folders (``1777``; the legacy lock file with the host's
    folder), then check every folder from ``/`` down (:func:`check_dir`); the book's trust
    state (:func:`trust`), or :class:`BookError` with the fix."""
    check_ancestors(base, directory)
    for path in (base, directory):
        if not os.path.lexists(path):
            _make(path)
        check_dir(path, [base, directory])
    return trust([base, directory])


def _make(folder: str) -> None:
    parent = os.path.dirname(folder)
    if not os.path.lexists(parent):
        _make(parent)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        return  # another user made it just now: checked like any existing one
    except OSError as exc:
        raise BookError(f"cannot create the lease book {folder}: {exc.strerror}",
                        f"point {ROOT_VAR} at a folder you can write, or "
                        f"{root_fix([folder])}") from None
    os.chmod(folder, 0o1777)  # ours, just made: shared with the sticky bit
    with suppress(OSError):  # what orchestrates before the folder lock flock
        os.close(os.open(os.path.join(folder, LOCK_FILE),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))


def check_ancestors(base: str, directory: str = "") -> None:
    """Every folder above the book, as written and as resolved: owned by root or this user,
    and writable by nobody else unless it has the sticky bit (like ``/tmp``). Otherwise whoever
    can write there can rename the book away and put their own in its place."""
    me = os.geteuid()
    seen = []
    for path in (base, os.path.realpath(base)):
        folder = os.path.dirname(path)
        while folder not in seen:
            seen.append(folder)
            info = lstat_or_none(folder)
            if info is not None:
                mode = stat.S_IMODE(info.st_mode)
                if info.st_uid not in (0, me) or (mode & 0o022 and not mode & stat.S_ISVTX):
                    raise BookError(
                        f"the lease book {base} is below {folder} (owner "
                        f"{user_name(info.st_uid)}, mode {mode:04o}), which another user "
                        "could use to replace the book",
                        root_fix([f for f in (folder, base, directory) if f])
                        if info.st_uid != 0 else f"point {ROOT_VAR} at a folder below "
                        f"folders only root controls, made {root_fix([base])}")
            if folder == os.path.dirname(folder):
                break
            folder = os.path.dirname(folder)


def check_dir(path: str, folders: list[str] | None = None) -> None:
    """Refuse a lease folder that other users could tamper with, or that this user cannot use:
    a link, not a folder, writable by others without the sticky bit, or owned by another user
    who is not root (a folder's owner can delete every file in it, sticky bit or not)."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise BookError(f"cannot use the lease book {path}: {exc.strerror}") from None
    fix = root_fix(folders or [path])
    if stat.S_ISLNK(info.st_mode):
        raise BookError(f"the lease book {path} is a symbolic link",
                        f"remove it, or point {ROOT_VAR} at a real folder")
    if not stat.S_ISDIR(info.st_mode):
        raise BookError(f"the lease book {path} is not a folder", fix)
    mode, owner = stat.S_IMODE(info.st_mode), info.st_uid
    mine = owner == os.geteuid()
    sticky = bool(mode & stat.S_ISVTX)
    if mode & 0o022 and not sticky:
        raise BookError(
            f"the lease book {path} is writable by other users but has no sticky bit (mode "
            f"{mode:04o}): anyone could delete or replace another user's leases",
            f"chmod 1777 {path}" if mine else fix)
    if not mine and owner != 0:
        raise BookError(f"the lease book {path} belongs to {user_name(owner)} (mode "
                        f"{mode:04o}), who could delete or hide every other user's leases",
                        fix)
    if not os.access(path, os.W_OK | os.X_OK):
        raise BookError(f"the lease book {path} is not writable by you (mode {mode:04o}, owner "
                        f"{user_name(owner)})", fix)


def trust(folders: list[str]) -> str:
    """Who can subvert this book: nobody but root (root made it), or its owner (this user made
    it: other users refuse it until root takes it over)."""
    owners = {info.st_uid for info in map(lstat_or_none, folders) if info is not None}
    if owners <= {0}:
        return "made by root: no user can delete or hide another's leases"
    return (f"made by {user_name(os.geteuid())}: other users refuse it until root takes it "
            f"over ({root_fix(folders)})")


def read_file(path: str) -> tuple[bytes | None, str, os.stat_result | None]:
    """A lease or ticket file's bytes (no link followed, bounded), or None with why it cannot
    be read; and its stat."""
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
    return data, "", info


def lstat_or_none(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None



class Locked:
    """An exclusive ``flock`` of the book's folder itself (no file any user could squat, make
    unreadable or swap: only root can replace a root-made folder), waited for at most
    ``wait_s``; then of the legacy lock file, which orchestrates before this one lock, if it is
    a usable file (one that is not is skipped, its owner named in ``notes``)."""

    def __init__(self, path: str, wait_s: float, notes: list[str] | None = None) -> None:
        self.path = path  # the legacy lock file; its folder is the lock
        self.wait_s = wait_s
        self.notes = notes if notes is not None else []
        self.fds: list[int] = []

    def __enter__(self) -> None:
        folder = os.path.dirname(self.path)
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise BookError(f"cannot open the lease book {folder}: {exc.strerror}") from None
        deadline = time.monotonic() + self.wait_s
        self._hold(fd, deadline)
        legacy = self._legacy()
        if legacy is not None:
            self._hold(legacy, deadline)

    def _legacy(self) -> int | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            info = lstat_or_none(self.path)
            self.notes.append(_skipped(self.path, exc.strerror or str(exc), info))
            return None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            self.notes.append(_skipped(self.path, "not a file", info))
            return None
        return fd

    def _hold(self, fd: int, deadline: float) -> None:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.fds.append(fd)
                return
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    os.close(fd)
                    self.__exit__()
                    raise BookError(f"cannot lock the lease book {self.path}: "
                                    f"{exc.strerror}") from None
            if time.monotonic() > deadline:
                holder = lock_holder(os.fstat(fd))
                os.close(fd)
                self.__exit__()
                raise BookError(
                    f"the lease book {os.path.dirname(self.path)} stayed locked for "
                    f"{self.wait_s:g}s by {holder}",
                    "that process holds the lock of every user's leases: ask its owner (or "
                    "root) to stop it", busy=True) from None
            time.sleep(0.02)

    def __exit__(self, *_: object) -> None:
        for fd in reversed(self.fds):
            with suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self.fds = []


def _skipped(path: str, why: str, info: os.stat_result | None) -> str:
    owner = user_name(info.st_uid) if info is not None else "?"
    return (f"the old lock file {path} ({why}, owner {owner}) is skipped: orchestrate locks "
            f"the book's folder; {owner} or root can remove it")


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
    "DEFAULT_ROOT",
    "LOCK_FILE",
    "LOCK_WAIT_S",
    "ROOT_VAR",
    "BookError",
    "Locked",
    "book_root",
    "check_ancestors",
    "check_dir",
    "lock_holder",
    "lstat_or_none",
    "open_book",
    "parse_name",
    "read_file",
    "root_fix",
    "trust",
]
