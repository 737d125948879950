"""Per-rank log files and the merged, prefixed stream of all ranks.

One writer (the job's supervisor) appends every line to the rank's own file and to the merged
``output.log`` with a ``[node:rank]`` prefix, under one lock: a line is never split or
interleaved with another rank's, and ``--follow`` simply tails one file.
"""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path
from typing import IO

from orchestrate.layout import LOG_DIR, MERGED_LOG, rank_log


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

    def line(self, rank: int, text: str) -> None:
        """One line of a rank's output (without its newline)."""
        with self._lock:
            self._files[rank].write(text + "\n")
            self._files[rank].flush()
            self._merged.write(self._prefix[rank] + text + "\n")
            self._merged.flush()

    def note(self, text: str) -> None:
        """A line from orchestrate itself, in the merged log."""
        with self._lock:
            self._merged.write(f"[orchestrate] {text}\n")
            self._merged.flush()

    def close(self) -> None:
        """Close every file."""
        with self._lock:
            for f in (*self._files.values(), self._merged):
                f.close()


def last_lines(path: Path, count: int = 10) -> list[str]:
    """The last ``count`` lines of a file ([] if it does not exist)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=count)]
    except OSError:
        return []
