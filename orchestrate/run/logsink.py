"""Per-rank log files and the merged, prefixed stream of all ranks.

One writer (the job's supervisor) appends every line to the rank's own file and to the merged
``output.log`` with a ``[node:rank]`` prefix, under one lock: a line is never split or
interleaved with another rank's, and ``--follow`` simply tails one file.

A log that cannot be written (the run directory's file system is full, it went away) must not
stop the supervisor from draining the ranks' output: a rank whose pipe nobody reads blocks in
``write()`` and the job would hang with no word. So a failed write is remembered as
:attr:`LogSink.error` (the supervisor then stops the job and says why), and later lines are
dropped, never raised.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from pathlib import Path
from typing import IO

from orchestrate.core.layout import LOG_DIR, MERGED_LOG, rank_log


class LogSink:
    """Writes rank lines to their files and the merged log."""

    def __init__(self, run_dir: Path, ranks: dict[int, str]) -> None:
        (run_dir / LOG_DIR).mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._merged = open(run_dir / MERGED_LOG, "a", encoding="utf-8")  # noqa: SIM115
        self._files: dict[int, IO[str]] = {
            rank: open(rank_log(run_dir, rank), "a", encoding="utf-8")  # noqa: SIM115
            for rank in ranks
        }
        self._prefix = {rank: f"[{node}:{rank}] " for rank, node in ranks.items()}
        #: Why the log could not be written (the first failure), e.g. "No space left on
        #: device (/runs/x/output.log)"; None while every write works.
        self.error: str | None = None
        self.dropped = 0

    def line(self, rank: int, text: str) -> None:
        """One line of a rank's output (without its newline)."""
        with self._lock:
            if self.error is not None:
                self.dropped += 1
                return
            try:
                self._files[rank].write(text + "\n")
                self._files[rank].flush()
                self._merged.write(self._prefix[rank] + text + "\n")
                self._merged.flush()
            except (OSError, ValueError) as exc:
                self._failed(exc)

    def note(self, text: str) -> None:
        """A line from orchestrate itself, in the merged log (dropped if it cannot be)."""
        with self._lock:
            if self.error is not None:
                return
            try:
                self._merged.write(f"[orchestrate] {text}\n")
                self._merged.flush()
            except (OSError, ValueError) as exc:
                self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, OSError):
            where = f" ({exc.filename})" if exc.filename else ""
            self.error = f"{exc.strerror or exc}{where}"
        else:
            self.error = str(exc)
        self.dropped += 1

    def close(self) -> None:
        """Close every file (a file that cannot be flushed any more is closed all the same)."""
        with self._lock:
            for f in (*self._files.values(), self._merged):
                with contextlib.suppress(OSError):
                    f.close()


def last_lines(path: Path, count: int = 10) -> list[str]:
    """The last ``count`` lines of a file ([] if it does not exist)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=count)]
    except OSError:
        return []
