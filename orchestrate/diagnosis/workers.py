"""The stacks of a rank's forked children (DataLoader workers), on the sidecar's request.

A rank whose data comes from DataLoader workers waits in torch's loader while the worker that
owes it the next batch is stuck in the dataset's code: the rank's own stack names only the wait.
The worker's stack is what names the cause, and the sidecar does not run in it (a forked child
has no sidecar thread; a spawned one leaves it off: :mod:`orchestrate.diagnosis.activation`).

So the sidecar arms every child the rank forks (``os.register_at_fork``: multiprocessing's
``fork`` start method, the DataLoader's default on Linux): right after the fork the child opens
``diag/workers/rank-R.pid-P.stacks.txt`` (a header naming its main thread) and registers
faulthandler for :data:`SIGNAL`, which the interpreter answers in C, even while a thread holds
the GIL in native code. When asked for a dump, the sidecar signals each live armed child (one
that still catches the signal: a child that ``exec``'d another program does not, and is never
signalled), waits up to :data:`WAIT_S` for the stacks, and appends them to the rank's answer
(``# worker pid P ...`` sections after the rank's own threads: :func:`sections`). Children of
spawned or forkserver loaders, and children that are not Python, are not reached. Files of
children that ended are removed at the next dump or cleanup. Standard library only, Python 3.8+.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time

from orchestrate.diagnosis.diagfiles import DiagFiles
from orchestrate.diagnosis.threadstate import read_thread

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any

#: The signal a child answers with its stacks: a real-time one, which nothing else of torch,
#: NCCL, Slurm or the trainer uses (they use SIGUSR1/SIGUSR2/SIGTERM).
SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else None
WAIT_S = 1.0  # how long a dump waits for all children's stacks
_SETTLE_S = 0.05  # a stacks file that stopped growing this long is complete
_armed: list[Any] = []  # [DiagFiles, rank] once armed in this process
_handle: IO[str] | None = None  # the child's open stacks file (kept open for faulthandler)


def arm(files: DiagFiles, rank: int) -> bool:
    """Arm every child this process forks from now on (once per process); False where the
    platform cannot (no ``register_at_fork`` or no real-time signals)."""
    if SIGNAL is None or not hasattr(os, "register_at_fork"):
        return False
    if not _armed:
        _armed[:] = [files, rank]
        os.register_at_fork(after_in_child=_in_child)
    return True


def _in_child() -> None:
    """In a freshly forked child: open the stacks file and let faulthandler answer SIGNAL."""
    global _handle
    if not _armed or SIGNAL is None:
        return
    files, rank = _armed
    try:
        path = files.worker_stacks(rank, os.getpid())
        os.makedirs(str(path.parent), exist_ok=True)
        handle = open(str(path), "a", encoding="utf-8")  # noqa: SIM115 (kept open)
        handle.write(f"# orchestrate worker of rank {rank}: pid {os.getpid()} parent "
                     f"{os.getppid()}\n# main thread 0x{threading.get_ident():016x}\n"
                     f"# stdlib {os.path.dirname(os.__file__)}\n")
        handle.flush()
        faulthandler.register(SIGNAL, file=handle, all_threads=True, chain=False)
        if _handle is not None:
            _handle.close()  # a grandchild: its parent's file is not its own
        _handle = handle
    except Exception:
        pass  # never fail a fork of the rank


def _catches(pid: int) -> bool:
    """Whether ``pid`` still has a handler for SIGNAL (``SigCgt`` in its status)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(SIGNAL or 1) - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _children(files: DiagFiles, rank: int) -> list[tuple[int, str]]:
    """The armed children's pids and stacks files; the files of children that ended are
    removed."""
    prefix = f"rank-{rank}.pid-"
    found = []
    try:
        names = os.listdir(str(files.workers))
    except OSError:
        return []
    for name in sorted(names):
        if not (name.startswith(prefix) and name.endswith(".stacks.txt")):
            continue
        digits = name[len(prefix):-len(".stacks.txt")]
        path = os.path.join(str(files.workers), name)
        if not digits.isdigit():
            continue
        pid = int(digits)
        if _catches(pid):
            found.append((pid, path))
        elif not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.unlink(path)
    return found


def cleanup(files: DiagFiles, rank: int) -> None:
    """Remove the stacks files of children that ended."""
    _children(files, rank)


def _settled(path: str, start: int, deadline: float) -> str | None:
    """The text appended to ``path`` after ``start``, once it stops growing (None by the
    deadline)."""
    size = seen_at = -1.0
    while time.monotonic() < deadline:
        try:
            now_size = os.path.getsize(path)
        except OSError:
            return None
        if now_size > start:
            if now_size != size:
                size, seen_at = now_size, time.monotonic()
            elif time.monotonic() - seen_at >= _SETTLE_S:
                with open(path, encoding="utf-8", errors="replace") as handle:
                    handle.seek(start)
                    return handle.read()
        time.sleep(0.01)
    return None


def _header(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        lines = [line for line in handle.read(4096).splitlines(True)[:3]
                 if line.startswith("#")]
    return "".join(lines)


def sections(files: DiagFiles, rank: int, wait_s: float = WAIT_S) -> str:
    """Ask every live armed child of rank ``rank`` for its stacks: one section each, for the
    end of the rank's stacks file (``# worker pid P: state ... `` then faulthandler's dump;
    ``(no answer)`` when it did not write in time)."""
    children = _children(files, rank)
    if not children or SIGNAL is None:
        return ""
    starts = {}
    for pid, path in children:
        try:
            starts[pid] = os.path.getsize(path)
            os.kill(pid, SIGNAL)
        except OSError:
            continue
    deadline = time.monotonic() + wait_s
    out = []
    for pid, path in children:
        if pid not in starts:
            continue
        text = _settled(path, starts[pid], deadline)
        _, kernel = read_thread(str(pid), pid)
        head = (f"\n# worker pid {pid}: state {kernel.state or '?'}, wchan {kernel.wchan or '-'}"
                f", syscall {kernel.syscall or '-'}, target {kernel.target or '-'}\n")
        try:
            header = _header(path)
        except OSError:
            header = ""
        out.append(head + header + (text if text is not None else "(no answer)\n"))
    return "".join(out)
