"""A command run on a pseudo-terminal, as a person runs it: what it draws there, read as it comes,
and Ctrl-C sent to its process group as a terminal sends it.

The CLI draws on a terminal what it never writes to a pipe (the live view, progress lines), so
the tests of those run it here; :meth:`Terminal.interrupt` is SIGINT to the foreground process
group, which is what the terminal's Ctrl-C does (a job's ranks, in their own session, never get
it).
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


class Terminal:
    """``python -m orchestrate ARGS`` (or ``argv``) on a new pty of ``columns`` x ``rows``."""

    def __init__(self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str],
                 columns: int = 150, rows: int = 40) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        environment = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES")}
        environment["TERM"] = "xterm-256color"
        self.proc = subprocess.Popen(list(argv), cwd=cwd, env=environment, stdin=slave,
                                     stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        self._master = master
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def orchestrate(cls, *args: str, cwd: Path, env: Mapping[str, str]) -> Terminal:
        return cls([sys.executable, "-m", "orchestrate", *args], cwd=cwd, env=env)

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self._master, 65536)
            except OSError:  # EIO: every writer closed its end
                return
            if not chunk:
                return
            self._chunks.append(chunk)

    def text(self) -> str:
        """Everything drawn so far, control sequences included."""
        return b"".join(self._chunks).decode("utf-8", errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> str:
        """The text once ``pattern`` (a regular expression) is in it; fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            if re.search(pattern, text, flags=re.S):
                return text
            if time.monotonic() > deadline or (self.proc.poll() is not None
                                               and not self._reader.is_alive()):
                raise AssertionError(f"the terminal never showed {pattern!r}:\n{text}")
            time.sleep(0.1)

    def interrupt(self) -> None:
        """Ctrl-C: SIGINT to the command's process group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def wait(self, timeout: float) -> int:
        """The command's exit status (its output read to the end)."""
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._reader.join(timeout=10)
        os.close(self._master)
