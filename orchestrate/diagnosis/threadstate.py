"""What the kernel says a thread is doing (Linux ``/proc``): its state, wait channel, the
system call it sleeps in and the file that call is on, its CPU time, and how long it waited
for a CPU.

Python's frames cannot tell a rank sleeping in ``time.sleep`` from one blocked reading a file
on slow storage, or one computing from one waiting: the kernel can. The rank sidecar
(:mod:`orchestrate.diagnosis.sidecar`) reads its main thread here at every heartbeat (four small
files, about 40 us) and its forked children's when asked (:mod:`orchestrate.diagnosis.workers`);
the stall rule (:mod:`orchestrate.diagnosis.stallrule`) decides from the result
(:class:`~orchestrate.diagnosis.kernelstate.KernelState`).

``/proc/PID/task/TID/syscall`` holds ``NR arg1 ... arg6 sp pc`` while the thread sleeps in a
system call (``running`` on a CPU, ``-1 sp pc`` outside one); the number is named from the
table of this machine's architecture (x86_64, aarch64; another shows ``#NR``). For a call on
a file descriptor, ``/proc/PID/fd/ARG1`` names what it is. A thread may read its own
process's files; a child's are readable to its owner. Anything unreadable reads as unknown
(None), never as an error.

**Waiting for a CPU is computing too.** A thread that computes on a machine with more runnable
threads than cores gets a share of a core, not a core: at load 16 on 2 cores a rank in one long
CPU step used 12% of a core, below the stall rule's bar, and a healthy job was killed as stalled.
``/proc/PID/task/TID/schedstat`` (``on-CPU ns, run-queue wait ns, slices``) also says how long the
thread was runnable but waiting: on CPU plus waiting is what it *wanted*, whatever the machine's
load (:func:`run_wait`). Standard library only, Python 3.8+ (the sidecar folder carries a
copy: :mod:`orchestrate.diagnosis.rankpackage`).
"""

from __future__ import annotations

import os
import platform

from orchestrate.diagnosis.kernelstate import KernelState

#: System calls whose first argument is a file descriptor (their target is resolved).
_ON_FD = frozenset((
    "read", "write", "pread64", "pwrite64", "readv", "writev", "preadv", "pwritev", "preadv2",
    "pwritev2", "fsync", "fdatasync", "sync_file_range", "syncfs", "ftruncate", "fallocate",
    "getdents64", "close", "fstat", "sendfile", "splice", "copy_file_range", "ioctl",
    "recvfrom", "recvmsg", "sendto", "sendmsg", "accept", "accept4", "connect",
))

_X86_64 = {
    0: "read", 1: "write", 2: "open", 3: "close", 4: "stat", 5: "fstat", 6: "lstat",
    7: "poll", 16: "ioctl", 17: "pread64", 18: "pwrite64", 19: "readv", 20: "writev",
    23: "select", 26: "msync", 35: "nanosleep", 40: "sendfile", 42: "connect", 43: "accept",
    44: "sendto", 45: "recvfrom", 46: "sendmsg", 47: "recvmsg", 61: "wait4", 74: "fsync",
    75: "fdatasync", 76: "truncate", 77: "ftruncate", 82: "rename", 83: "mkdir", 84: "rmdir",
    85: "creat", 87: "unlink", 162: "sync", 202: "futex", 208: "io_getevents",
    217: "getdents64", 230: "clock_nanosleep", 232: "epoll_wait", 247: "waitid",
    257: "openat", 258: "mkdirat", 262: "newfstatat", 263: "unlinkat", 264: "renameat",
    270: "pselect6", 271: "ppoll", 275: "splice", 277: "sync_file_range", 281: "epoll_pwait",
    285: "fallocate", 288: "accept4", 295: "preadv", 296: "pwritev", 306: "syncfs",
    316: "renameat2", 326: "copy_file_range", 327: "preadv2", 328: "pwritev2", 332: "statx",
    333: "io_pgetevents", 426: "io_uring_enter", 437: "openat2", 441: "epoll_pwait2",
}
_AARCH64 = {  # the generic table (asm-generic/unistd.h)
    4: "io_getevents", 22: "epoll_pwait", 29: "ioctl", 34: "mkdirat", 35: "unlinkat",
    38: "renameat", 45: "truncate", 46: "ftruncate", 47: "fallocate", 56: "openat",
    57: "close", 61: "getdents64", 63: "read", 64: "write", 65: "readv", 66: "writev",
    67: "pread64", 68: "pwrite64", 69: "preadv", 70: "pwritev", 71: "sendfile",
    72: "pselect6", 73: "ppoll", 76: "splice", 79: "newfstatat", 80: "fstat", 81: "sync",
    82: "fsync", 83: "fdatasync", 84: "sync_file_range", 95: "waitid", 98: "futex",
    101: "nanosleep", 115: "clock_nanosleep", 202: "accept", 203: "connect", 206: "sendto",
    207: "recvfrom", 211: "sendmsg", 212: "recvmsg", 227: "msync", 242: "accept4",
    260: "wait4", 267: "syncfs", 276: "renameat2", 285: "copy_file_range", 286: "preadv2",
    287: "pwritev2", 291: "statx", 292: "io_pgetevents", 426: "io_uring_enter",
    437: "openat2", 441: "epoll_pwait2",
}
_TABLES = {"x86_64": _X86_64, "amd64": _X86_64, "aarch64": _AARCH64, "arm64": _AARCH64}
_NAMES: dict[int, str] = _TABLES.get(platform.machine().lower(), {})


def _clock_ticks() -> float | None:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return None


_TICKS = _clock_ticks()


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read(512)
    except OSError:
        return None


def run_wait(pid: str, tid: int) -> float | None:
    """Seconds a thread has spent runnable but waiting for a CPU (the second field of
    ``schedstat``); None where the kernel keeps no scheduler statistics."""
    fields = (_read(f"/proc/{pid}/task/{tid}/schedstat") or "").split()
    try:
        return int(fields[1]) / 1e9
    except (IndexError, ValueError):
        return None


def syscall_of(text: str | None, pid: str = "self") -> tuple[str | None, str | None]:
    """The system call named by a ``syscall`` file's text, and what its descriptor is: a path,
    ``pipe:[N]``, ``socket:[N]``, or ``fd N`` when it cannot be read; ``(None, None)`` outside a
    call or when unknown."""
    fields = (text or "").split()
    if not fields or not fields[0].lstrip("-").isdigit() or int(fields[0]) < 0:
        return None, None
    number = int(fields[0])
    name = _NAMES.get(number, f"#{number}")
    if name not in _ON_FD or len(fields) < 2:
        return name, None
    try:
        fd = int(fields[1], 16)
    except ValueError:
        return name, None
    try:
        return name, os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return name, f"fd {fd}"


def read_thread(pid: str, tid: int) -> tuple[float | None, KernelState]:
    """A thread's CPU seconds (user + system; None where unknown) and kernel state, ``pid``
    being ``"self"`` or a number."""
    base = f"/proc/{pid}/task/{tid}/"
    stat = _read(base + "stat")
    cpu = state = None
    if stat is not None:
        try:
            fields = stat.rsplit(")", 1)[1].split()
            state = fields[0]
            if _TICKS:
                cpu = (int(fields[11]) + int(fields[12])) / _TICKS
        except (IndexError, ValueError):
            pass
    wchan = (_read(base + "wchan") or "").strip()
    syscall, target = (None, None)
    if state in ("S", "D"):
        syscall, target = syscall_of(_read(base + "syscall"), pid)
    return cpu, KernelState(state, wchan if wchan and wchan != "0" else None, syscall, target)
