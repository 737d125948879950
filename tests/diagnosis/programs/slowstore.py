"""Slow storage for the tests, without FUSE or root: a read that sleeps in read(2) on a path.

:func:`slow_read` reads one byte from a named FIFO that a thread of the same process feeds
only after ``seconds``: the caller's thread sleeps in the ``read`` system call on a file of the
file system (``/proc/self/task/TID/syscall`` shows ``read`` on the FIFO's path, state ``S``),
which is what a read or a write on slow network storage (NFS, a parallel file system) looks
like to the kernel. (A real ``D``-state wait needs a throttled or hung block device; the
stall rule treats both the same: orchestrate.diagnosis.kernelstate.KernelState.file_io.)
"""

from __future__ import annotations

import os
import tempfile
import threading
import time


def slow_read(seconds: float, folder: str | None = None) -> None:
    """Block this thread in read(2) on a FIFO for ``seconds`` (forever when negative)."""
    folder = folder or os.environ.get("MARKS") or tempfile.gettempdir()
    path = os.path.join(folder, f"slow-{os.getpid()}-{threading.get_ident()}.fifo")
    os.mkfifo(path)

    def feed() -> None:
        with open(path, "wb") as writer:  # opens once the reader does
            time.sleep(seconds if seconds >= 0 else 1e9)
            writer.write(b"x")

    threading.Thread(target=feed, name="slow-storage", daemon=True).start()
    try:
        with open(path, "rb", buffering=0) as reader:
            reader.read(1)  # the slow read
    finally:
        os.unlink(path)
