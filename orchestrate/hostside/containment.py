"""Keeping a job's processes together: a child subreaper, its descendants, a per-job cgroup.

The job tag (``ORCHESTRATE_JOB_ID``, :mod:`orchestrate.hostside.host`) finds a job's processes
only while they keep it: a rank's daemon that double-forks and runs ``env -i ...`` drops it and
used to outlive its job, its lease released while it may still hold the GPU. Three more nets,
each used where it can be:

- **ancestry**: the local supervisor and each SSH agent are *child subreapers*
  (``prctl(PR_SET_CHILD_SUBREAPER)``): an orphan below them re-parents to them, not to init, so
  every process a rank started stays their descendant, whatever it did to its environment or
  session, and is swept at the job's end;
- **a per-job cgroup**, where one can be made (cgroup v2 below this process's own cgroup when it
  is delegated; cgroup v1's ``pids`` hierarchy, as root): membership is inherited and cannot be
  left without privileges, and ``cgroup.procs`` is readable by every user;
- what is left alive after SIGKILL (a process in uninterruptible sleep, one of another user) is a
  *survivor*: named in the job's ending, and its lease stays held while it lives.

Standard library only, Python 3.8+ (shipped to SSH hosts inside the agent).
"""

from __future__ import annotations

import os
import signal
import time

from orchestrate.hostside.host import alive, proc_start, signal_all, suppress, tagged

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

PR_SET_CHILD_SUBREAPER = 36
CGROUP_ROOT = "/sys/fs/cgroup"
#: Set (to anything) to make no cgroup: the ancestry and the tag are then the only nets.
NO_CGROUP_VAR = "ORCHESTRATE_NO_CGROUP"
#: After SIGKILL, how long a process gets to be gone before it counts as a survivor.
KILL_WAIT_S = 3.0


def become_subreaper() -> bool:
    """Make this process a child subreaper: orphans below it re-parent to it. False where the
    kernel (or platform) does not offer it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def reap_orphans(keep: set[int] | None = None) -> None:
    """Collect the exit of this subreaper's children that ended (re-parented orphans), except
    ``keep`` (children a ``subprocess.Popen`` waits for itself)."""
    me = os.getpid()
    for pid, (parent, state) in _table().items():
        if parent == me and state == "Z" and pid not in (keep or set()):
            with suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)


def _table() -> dict[int, tuple[int, str]]:
    """Every process here: pid -> (parent pid, state letter); one scan of /proc."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        found[int(name)] = (int(fields[1]), fields[0].decode())
    return found


def descendants(root: int, skip: set[int] | None = None) -> list[int]:
    """The live descendants of ``root`` (not ``root``), leaving out ``skip`` and what is below
    a skipped process."""
    children: dict[int, list[int]] = {}
    for pid, (parent, state) in _table().items():
        if state not in ("Z", "X"):
            children.setdefault(parent, []).append(pid)
    found, todo, skipped = [], [root], skip or set()
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in skipped:
                found.append(child)
                todo.append(child)
    return found


def owner_uid(pid: int) -> int | None:
    """The user a process runs as (the owner of its /proc entry), None if it is gone."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def user_name(uid: int | None) -> str:
    """A user's login name, or the number when the system has no name for it."""
    if uid is None:
        return "?"
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return str(uid)


def command_name(pid: int) -> str:
    """A process's command name (``/proc/PID/comm``), ``?`` when unreadable."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


def describe_pid(pid: int) -> str:
    """``pid 4242 (ben, python3)``."""
    return f"pid {pid} ({user_name(owner_uid(pid))}, {command_name(pid)})"


def _clock() -> tuple[float, float]:
    """Boot time (wall clock) and clock ticks per second: a start time in ticks to seconds."""
    boot = 0.0
    with suppress(OSError, ValueError), open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                boot = float(line.split()[1])
    return boot, float(os.sysconf("SC_CLK_TCK"))


def started_before(uid: int, when: float) -> bool:
    """Whether a live process of ``uid`` started before ``when`` (wall clock; a second of
    slack, the boot time has no finer grain)."""
    boot, ticks = _clock()
    for name in os.listdir("/proc"):
        if not name.isdigit() or owner_uid(int(name)) != uid:
            continue
        start = proc_start(int(name))
        if start is not None and boot + start / ticks <= when + 1.0:
            return True
    return False


def started_at(pid: int) -> float | None:
    """When a live process started (wall clock, to the second); None if it is gone."""
    start = proc_start(pid)
    if start is None:
        return None
    boot, ticks = _clock()
    return boot + start / ticks


class OldestStarts:
    """Each user's oldest live process (when it started, wall clock), read from ``/proc`` once,
    the first time it is asked: 1,000 unreadable leases cost one pass, not a thousand."""

    def __init__(self) -> None:
        self.found: dict[int, float] | None = None

    def before(self, uid: int, when: float) -> bool:
        """Whether a live process of ``uid`` started before ``when`` (a second of slack)."""
        if self.found is None:
            boot, ticks = _clock()
            self.found = {}
            for name in os.listdir("/proc"):
                owner, start = (owner_uid(int(name)), proc_start(int(name))) \
                    if name.isdigit() else (None, None)
                if owner is not None and start is not None:
                    began = boot + start / ticks
                    self.found[owner] = min(self.found.get(owner, began), began)
        return uid in self.found and self.found[uid] <= when + 1.0


class TagScan:
    """One scan of ``/proc/*/environ`` for job tags, made the first time it is needed."""

    def __init__(self) -> None:
        self.found: dict[str, list[int]] | None = None

    def running(self, job_id: str, uid: int) -> bool:
        """Whether a process of ``uid`` carries ``job_id``'s tag."""
        if self.found is None:
            self.found = tagged()
        return any(owner_uid(pid) == uid for pid in self.found.get(job_id, []))


def live_survivors(pairs: object) -> list[int]:
    """The pids still alive of a lease's ``survivors`` (``[[pid, start], ...]``: processes of
    its job that outlived SIGKILL at its end); they hold the lease, and whoever is refused for
    it, or asks ``orchestrate gpus``, is told which they are."""
    if not isinstance(pairs, list):
        return []
    return [int(p) for p, s in pairs if alive(int(p), None if s is None else int(s))]


def stop_processes(find: Callable[[], list[int]], grace_s: float,
                   kill_wait_s: float = KILL_WAIT_S) -> list[int]:
    """Stop what ``find`` lists: SIGTERM (+SIGCONT), SIGKILL after ``grace_s``; the pids still
    alive ``kill_wait_s`` after that (survivors)."""
    pids = find()
    if not pids:
        return []
    signal_all(pids, signal.SIGTERM)
    left = _wait_gone(find, grace_s)
    if not left:
        return []
    signal_all(left, signal.SIGKILL)
    return _wait_gone(find, kill_wait_s)


def _wait_gone(find: Callable[[], list[int]], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    left = find()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = find()
    return left


# ------------------------------------------------------------------------------ cgroups


def _own_cgroup(controller: str) -> str | None:
    """This process's cgroup path in ``controller``'s hierarchy ("" for cgroup v2)."""
    with suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            if names.split(",") == [controller] or (controller == "" and names == ""):
                return path
    return None


def _base() -> tuple[str, str] | None:
    """Where job cgroups go, and the cgroup this process is in now (to return to)."""
    if os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")):  # cgroup v2
        own = _own_cgroup("")
        if own is None:
            return None
        here = os.path.join(CGROUP_ROOT, own.lstrip("/"))
        return here, here
    pids = os.path.join(CGROUP_ROOT, "pids")
    own = _own_cgroup("pids")
    if not os.path.isdir(pids) or own is None:
        return None
    return os.path.join(pids, "orchestrate"), os.path.join(pids, own.lstrip("/"))


class JobGroup:
    """A cgroup of one job on this host: its processes are its members, wherever they went."""

    def __init__(self, path: str, home: str) -> None:
        self.path = path
        self.home = home  # the cgroup the creating process came from

    @classmethod
    def make(cls, key: str) -> JobGroup | None:
        """The job's cgroup (made, or joined when another process of the job made it), or None
        where none can be made (no permission, no cgroup file system, switched off)."""
        if os.environ.get(NO_CGROUP_VAR):
            return None
        base = _base()
        if base is None:
            return None
        parent, home = base
        path = os.path.join(parent, "orchestrate." + key) if parent == home \
            else os.path.join(parent, key)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError:
            return None
        return cls(path, home)

    def join(self, pid: int = 0) -> bool:
        """Move ``pid`` (0: this process) into the cgroup; its children are born there."""
        try:
            with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
                f.write(str(pid or os.getpid()))
            return True
        except OSError:
            return False

    def leave(self) -> None:
        """Move this process back where it came from."""
        with suppress(OSError), open(os.path.join(self.home, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def members(self, skip: set[int] | None = None) -> list[int]:
        """The live processes in the cgroup (as this PID namespace sees them)."""
        return [pid for pid in members(self.path) if pid not in (skip or set())]

    def remove(self) -> bool:
        """Remove the cgroup once it is empty; False while something is still in it."""
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True


def members(path: str) -> list[int]:
    """The live processes of a cgroup folder; [] if it cannot be read."""
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            pids = [int(word) for word in f.read().split()]
    except (OSError, ValueError):
        return []
    return [pid for pid in pids if pid > 0 and alive(pid, None)]


def alive_cgroup(path: object) -> bool:
    """Whether a lease's cgroup (a path under the cgroup file system) still has a process."""
    if not isinstance(path, str) or not path.startswith(CGROUP_ROOT + "/") or ".." in path:
        return False
    return bool(members(path))


__all__ = [
    "JobGroup",
    "OldestStarts",
    "TagScan",
    "alive_cgroup",
    "become_subreaper",
    "command_name",
    "descendants",
    "describe_pid",
    "live_survivors",
    "members",
    "owner_uid",
    "reap_orphans",
    "started_at",
    "started_before",
    "stop_processes",
    "user_name",
]
