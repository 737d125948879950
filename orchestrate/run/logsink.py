"""Where a local or SSH job's output goes: each rank's own file, and the merged view's index.

The supervisor is the one writer. Each piece of a rank's output (a line with its newline, or
:data:`~orchestrate.hostside.outputlog.LINE_MAX` bytes of a longer one: the rank handles never
read more at once) is appended, byte for byte, to the rank's file ``logs/rank-R.log``; its
place in the merged view is one short record in ``output.idx``
(:mod:`orchestrate.hostside.outputlog`: the view is derived, nothing is stored twice). A rank's
pieces that follow each other are one record, written when another rank or a note comes between,
and at least every :meth:`LogSink.flush` (the supervisor's loop: every 50 ms).

``logs.max_mb_per_rank`` caps what one rank may write in one attempt: past it, the rest of the
rank's output is read (a rank whose pipe nobody reads would block) and dropped, and the merged
view says so, once when the cap is reached and with the count at the end.

A log that cannot be written (the run directory's file system is full, it went away) must not
stop the supervisor from draining the ranks' output either: a failed write is remembered as
:attr:`LogSink.error` (the supervisor then stops the job and says why), and later output is
dropped, never raised.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from orchestrate.core.layout import LOG_DIR, MERGED_INDEX, rank_log, rank_log_name
from orchestrate.hostside.outputlog import Index, tail_lines

#: The cap's unit (``logs.max_mb_per_rank``): a MB of 2**20 bytes, as Slurm counts memory.
MB = 1 << 20


class LogSink:
    """Writes rank output to the rank's file and its order to the merged view's index."""

    def __init__(self, run_dir: Path, ranks: dict[int, str], cap_bytes: int | None = None
                 ) -> None:
        (run_dir / LOG_DIR).mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._index = Index(str(run_dir / MERGED_INDEX))
        self._fds: dict[int, int] = {}
        self._offsets: dict[int, int] = {}
        self._written = dict.fromkeys(ranks, 0)
        self._over: dict[int, int] = {}  # rank -> bytes dropped past the cap
        self.cap_bytes = cap_bytes
        self._pending: list[int] | None = None  # [rank, offset, length] not yet in the index
        for rank, node in ranks.items():
            fd = os.open(rank_log(run_dir, rank), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._fds[rank] = fd
            self._offsets[rank] = os.fstat(fd).st_size
            self._index.declare(rank, rank_log_name(rank), node)
        #: Why the log could not be written (the first failure), e.g. "No space left on
        #: device (/runs/x/logs/rank-0.log)"; None while every write works.
        self.error: str | None = None
        self.dropped = 0

    def line(self, rank: int, data: bytes) -> None:
        """One piece of a rank's output, as the rank wrote it (with its newline, if it had one)."""
        with self._lock:
            if self.error is not None:
                self.dropped += 1
                return
            try:
                data = self._capped(rank, data)
                if data:
                    self._append(rank, data)
            except (OSError, ValueError) as exc:
                self._failed(exc, rank_log_name(rank))

    def _capped(self, rank: int, data: bytes) -> bytes:
        """What of ``data`` is under the rank's cap; the first time it is reached, a note."""
        if self.cap_bytes is None:
            return data
        if rank in self._over:
            self._over[rank] += len(data)
            return b""
        room = self.cap_bytes - self._written.get(rank, 0)
        if len(data) <= room:
            return data
        self._over[rank] = len(data) - max(room, 0)
        kept = data[:max(room, 0)]
        if kept:
            self._append(rank, kept)
        self._note(f"rank {rank} reached logs.max_mb_per_rank "
                   f"({self.cap_bytes / MB:g} MB): the rest of its output in this attempt is "
                   "dropped")
        return b""

    def _append(self, rank: int, data: bytes) -> None:
        fd = self._fds[rank]
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        offset = self._offsets[rank]
        self._offsets[rank] = offset + len(data)
        self._written[rank] = self._written.get(rank, 0) + len(data)
        pending = self._pending
        if pending is not None and pending[0] == rank and pending[1] + pending[2] == offset:
            pending[2] += len(data)
            return
        self._flush()
        self._pending = [rank, offset, len(data)]

    def _flush(self) -> None:
        if self._pending is not None:
            rank, offset, length = self._pending
            self._pending = None
            self._index.part(rank, offset, length)

    def flush(self) -> None:
        """Put the pieces written so far into the merged view's index."""
        with self._lock:
            if self.error is None:
                try:
                    self._flush()
                except OSError as exc:
                    self._failed(exc, MERGED_INDEX)

    def note(self, text: str) -> None:
        """A line from orchestrate itself, in the merged view (dropped if it cannot be)."""
        with self._lock:
            if self.error is None:
                self._note(text)

    def _note(self, text: str) -> None:
        try:
            self._flush()
            self._index.note(text)
        except OSError as exc:
            self._failed(exc, MERGED_INDEX)

    def _failed(self, exc: BaseException, name: str) -> None:
        if isinstance(exc, OSError):
            self.error = f"{exc.strerror or exc} ({name})"
        else:
            self.error = str(exc)
        self.dropped += 1

    def close(self) -> None:
        """Record what is pending and what a cap dropped; close every file (a file that cannot
        be written any more is closed all the same)."""
        with self._lock:
            if self.error is None:
                for rank, over in sorted(self._over.items()):
                    self._note(f"rank {rank}: {over} byte(s) of output dropped past "
                               "logs.max_mb_per_rank")
                with contextlib.suppress(OSError):
                    self._flush()
            for fd in self._fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fds.clear()
            with contextlib.suppress(OSError):
                self._index.close()


def last_lines(path: Path, count: int = 10) -> list[str]:
    """The last ``count`` lines of a rank's file ([] if it does not exist), from its end only."""
    return tail_lines(str(path), count)
