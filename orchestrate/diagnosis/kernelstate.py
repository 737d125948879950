"""The kernel's view of one thread as a record (:class:`KernelState`), and which system calls
wait on the file system.

Read by :mod:`orchestrate.diagnosis.threadstate` (from ``/proc``), carried in every heartbeat
(:mod:`orchestrate.diagnosis.diagfiles`), judged by the stall rule (a rank blocked in file I/O
is busy, not stuck) and written into a diagnosis. Standard library only, Python 3.8+: shipped
with the sidecar, the Slurm monitor and the SSH hosts' ``evidence.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


#: System calls that wait on the file system: by file descriptor (``read``...) or by path
#: (``openat``, ``statx``...). A thread sleeping in one of them on a file (not a socket, a pipe
#: or an event fd: those wait for another process) is in slow I/O.
FILE_SYSCALLS = frozenset((
    "read", "write", "pread64", "pwrite64", "readv", "writev", "preadv", "pwritev", "preadv2",
    "pwritev2", "fsync", "fdatasync", "sync_file_range", "syncfs", "sync", "ftruncate",
    "fallocate", "copy_file_range", "sendfile", "splice", "msync", "getdents64", "close",
    "open", "openat", "openat2", "creat", "stat", "lstat", "fstat", "newfstatat", "statx",
    "rename", "renameat", "renameat2", "unlink", "unlinkat", "mkdir", "mkdirat", "rmdir",
    "truncate", "io_getevents", "io_pgetevents", "io_uring_enter",
))


@dataclass(frozen=True)
class KernelState:
    """The kernel's view of one thread (Linux ``/proc``): ``R`` on CPU, ``S`` sleeping, ``D``
    uninterruptible (disk), ``T`` stopped, with the wait channel when the kernel shows it, the
    system call it sleeps in (``/proc/.../syscall``: ``"read"``; None when it is in none or
    the file cannot be read) and, for a call on a file descriptor, what that descriptor is
    (``/proc/self/fd/N``: a path, ``pipe:[123]``, ``socket:[456]``)."""

    state: str | None = None
    wchan: str | None = None
    syscall: str | None = None
    target: str | None = None

    def file_io(self) -> bool:
        """Blocked in file I/O: uninterruptible (``D``), or sleeping in a file system call on
        a path (or on a descriptor that names one)."""
        if self.state == "D":
            return True
        if self.state != "S" or self.syscall not in FILE_SYSCALLS:
            return False
        return self.target is None or self.target.startswith("/")

    def io_text(self) -> str:
        """``read of /data/shard-3.bin (pipe_read)``, ``disk wait (nfs_wait_bit)``."""
        if self.syscall is None:
            what = "disk wait"
        else:
            what = self.syscall + (f" of {self.target}" if self.target else "")
        return f"{what} ({self.wchan})" if self.wchan else what

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state, "wchan": self.wchan}
        if self.syscall is not None:
            out["syscall"] = self.syscall
        if self.target is not None:
            out["target"] = self.target
        return out

    @classmethod
    def from_json(cls, data: Any) -> KernelState | None:
        if not isinstance(data, dict):
            return None
        return cls(_str(data.get("state")), _str(data.get("wchan")), _str(data.get("syscall")),
                   _str(data.get("target")))
