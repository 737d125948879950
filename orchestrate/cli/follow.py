"""Reading a job's output, and following it: the merged view (or one rank's file) as it is
written, and a progress line from its metrics.

Works for every backend: it reads the run directory's merged view (``output.idx`` over the
rank files, :mod:`orchestrate.hostside.outputlog`; a run directory of an older orchestrate has
``output.log`` instead) or one rank's log, a block at a time, so memory stays bounded however
large the logs, and ``metrics.jsonl`` every 50 ms, and asks the backend for the job's state at
the backend's own pace (:attr:`~orchestrate.backends.base.Backend.poll_interval_s`: a Slurm
controller is asked every 2 s, not 20 times a second), until the job ends; and at once when
``wake`` (the pipe of a supervisor this process started) reaches its end of file, which its
supervisor closes once the job's end is recorded: a followed local job's last 0-50 ms of
waiting for the next look. On a terminal the
lines are shown through :mod:`orchestrate.cli.terminal` (no control sequence of a rank's
reaches it); elsewhere they are the bytes as written.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol

from orchestrate.cli.interrupt import Interrupts
from orchestrate.cli.terminal import LineWriter, visible
from orchestrate.core.layout import MERGED_INDEX, METRICS, OLD_MERGED_LOG
from orchestrate.core.metricrecord import MetricRecord
from orchestrate.hostside.outputlog import Tail, View
from orchestrate.run.store import JobRecord

if TYPE_CHECKING:
    from rich.status import Status

POLL_S = 0.05
#: How long a followed job's end waits for its supervisor's last writes (the report) before
#: ``follow`` returns anyway: writing it takes well under a second, a stuck disk is not ours.
END_WAIT_S = 30.0


class Reader(Protocol):
    """Lines of output written since the last call (``final``: the writer is done)."""

    def lines(self, final: bool = False) -> Iterator[bytes]: ...


class _MergedView:
    def __init__(self, path: Path) -> None:
        self.view = View(str(path))

    def lines(self, final: bool = False) -> Iterator[bytes]:
        return self.view.lines()  # its parts are whole: nothing waits for an end


def reader(run_dir: Path, path: Path | None = None) -> Reader:
    """The job's merged view, or the file at ``path`` (one rank's log)."""
    if path is not None:
        return Tail(str(path))
    index = run_dir / MERGED_INDEX
    if not index.exists() and (run_dir / OLD_MERGED_LOG).exists():
        return Tail(str(run_dir / OLD_MERGED_LOG))
    return _MergedView(index)


def dump(source: Reader, out: IO[bytes] | None = None) -> None:
    """Everything written so far, to ``out`` (standard output): what ``logs`` prints."""
    writer = LineWriter(out or sys.stdout.buffer)
    for line in source.lines(final=True):
        writer.write(line)
    writer.flush()


def progress_text(metrics: MetricRecord) -> str:
    """One status line from the latest metrics (:meth:`MetricRecord.updated` by each record)."""
    parts = []
    for value, fmt in ((metrics.epoch, "epoch {}"), (metrics.step, "step {}"),
                       (metrics.train_loss, "loss {:.4g}"),
                       (metrics.val_accuracy, "val acc {:.3f}"),
                       (metrics.samples_per_s, "{:.0f} samples/s")):
        if value is not None:
            parts.append(fmt.format(value))
    return " | ".join(parts)


def _updated(latest: MetricRecord | None, lines: Iterator[bytes]) -> MetricRecord | None:
    """``latest`` updated by the records of new metrics.jsonl ``lines`` (later records update
    what earlier ones said; a line that is not a record is skipped)."""
    for line in lines:
        with contextlib.suppress(ValueError):
            record = MetricRecord.from_json(json.loads(line))
            if record is not None:
                latest = record if latest is None else latest.updated(record)
    return latest


def _show(lines: Iterator[bytes], writer: LineWriter, status: Status | None) -> int:
    """New output lines: above the progress line when there is one (a terminal: escaped), else
    through ``writer``; how many."""
    count = 0
    for line in lines:
        count += 1
        if status is not None:
            status.console.print(visible(line).rstrip("\n"), markup=False, highlight=False,
                                 soft_wrap=True)
        else:
            writer.write(line)
    writer.flush()
    return count


def follow(
    job: JobRecord,
    refresh: Callable[[], JobRecord],
    out: IO[bytes] | None = None,
    live: bool = False,
    from_start: bool = True,
    refresh_every_s: float = 0.2,
    path: Path | None = None,
    wake: IO[bytes] | None = None,
) -> JobRecord:
    """Print the job's merged view (or the file at ``path``) until it ends; returns the final
    record. ``refresh`` is called at most every ``refresh_every_s``. ``live``: a progress line
    on standard error (a terminal), the output printed above it. Ctrl-C raises
    :class:`KeyboardInterrupt` between two steps (:class:`~orchestrate.cli.interrupt.Interrupts`):
    the caller decides what it does to the job. ``wake``: a pipe whose end of file means the
    job's end is recorded (the state is read again at once)."""
    writer = LineWriter(out or sys.stdout.buffer)
    run_dir = Path(job.run_dir)
    log = reader(run_dir, path)
    metrics = Tail(str(run_dir / METRICS))
    if not from_start:
        for _ in log.lines():
            pass
    status: Status | None = None
    if live:
        from rich.console import Console
        from rich.status import Status as LiveStatus

        status = LiveStatus("starting the ranks; waiting for their first lines...",
                            console=Console(file=sys.stderr))
        status.start()
    try:
        with Interrupts() as interrupts:
            return _until_ended(job, refresh, refresh_every_s, log, metrics, writer, status,
                                interrupts, wake)
    finally:
        if status is not None:
            status.stop()


def _pause(wake: IO[bytes] | None) -> bool:
    """Wait :data:`POLL_S`, or less when ``wake`` reaches its end of file: True then."""
    if wake is None:
        time.sleep(POLL_S)
        return False
    ready, _, _ = select.select([wake], [], [], POLL_S)
    try:
        return bool(ready) and not os.read(wake.fileno(), 4096)
    except OSError:
        return True


def _until_closed(wake: IO[bytes], interrupts: Interrupts, job: JobRecord) -> None:
    """Wait (at most :data:`END_WAIT_S`) for ``wake``'s end of file: the store says the job
    ended, but its supervisor records the end first and writes the report after, so a
    ``submit --follow`` that returned at once could leave a user (or a script that opens
    ``report.html`` next) a run directory still being written. Past the wait, it says so."""
    deadline = time.monotonic() + END_WAIT_S
    while time.monotonic() < deadline:
        interrupts.check()
        if _pause(wake):
            return
    sys.stderr.write(f"job {job.id} ended, but its supervisor had not finished its last writes "
                     f"(the report) after {END_WAIT_S:g}s: see "
                     f"{Path(job.run_dir) / 'supervisor.log'}\n")


def _until_ended(job: JobRecord, refresh: Callable[[], JobRecord], refresh_every_s: float,
                 log: Reader, metrics: Tail, writer: LineWriter, status: Status | None,
                 interrupts: Interrupts, wake: IO[bytes] | None = None) -> JobRecord:
    """:func:`follow`'s loop."""
    latest: MetricRecord | None = None
    last_refresh = 0.0
    quiet = True  # no line yet: the status line says it waits for one
    while True:
        interrupts.check()
        shown = _show(log.lines(), writer, status)
        if status is not None:
            latest = _updated(latest, metrics.lines())
            if latest is not None:
                status.update(progress_text(latest))
            elif quiet and shown:
                status.update("running...")
        quiet = quiet and not shown
        now = time.monotonic()
        if now - last_refresh >= refresh_every_s:
            last_refresh = now
            job = refresh()
            if job.terminal:
                # Every backend records the end after the last line is written (a supervisor
                # closes its log first; Slurm ends the job after its steps): read it now.
                for line in log.lines(final=True):
                    writer.write(line)
                writer.flush()
                if wake is not None:  # the end is in the store; the report may not be yet
                    _until_closed(wake, interrupts, job)
                return job
        if _pause(wake):  # its supervisor recorded the end: read it now, then look as usual
            wake, last_refresh = None, 0.0
