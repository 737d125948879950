"""Following a job: its merged output as it is written, and a progress line from its metrics.

Works for every backend: it tails the run directory's ``output.log`` (or one rank's log) and
``metrics.jsonl`` every 50 ms, and asks the backend for the job's state at the backend's own
pace (:attr:`~orchestrate.backends.base.Backend.poll_interval_s`: a Slurm controller is asked
every 2 s, not 20 times a second), until the job ends.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from orchestrate.core.layout import MERGED_LOG, METRICS
from orchestrate.core.metricrecord import MetricRecord
from orchestrate.run.store import JobRecord

POLL_S = 0.05


class Tail:
    """Reads whole lines appended to a file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def lines(self) -> list[str]:
        """New complete lines."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *complete, self.partial = data.split(b"\n")
        return [line.decode("utf-8", errors="replace") for line in complete]


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


def _updated(latest: MetricRecord | None, lines: list[str]) -> MetricRecord | None:
    """``latest`` updated by the records of new metrics.jsonl ``lines`` (later records update
    what earlier ones said; a line that is not a record is skipped)."""
    for line in lines:
        with contextlib.suppress(ValueError):
            record = MetricRecord.from_json(json.loads(line))
            if record is not None:
                latest = record if latest is None else latest.updated(record)
    return latest


def follow(
    job: JobRecord,
    refresh: Callable[[], JobRecord],
    out: IO[str] | None = None,
    live: bool = False,
    from_start: bool = True,
    refresh_every_s: float = 0.2,
    path: Path | None = None,
) -> JobRecord:
    """Print the job's merged output (or the file at ``path``) until it ends; returns the final
    record. ``refresh`` is called at most every ``refresh_every_s``."""
    stream = out or sys.stdout
    run_dir = Path(job.run_dir)
    log = Tail(path or run_dir / MERGED_LOG)
    metrics = Tail(run_dir / METRICS)
    if not from_start:
        log.lines()
    status = None
    latest: MetricRecord | None = None
    if live:
        from rich.console import Console
        from rich.status import Status

        status = Status("starting...", console=Console(file=sys.stderr))
        status.start()
    try:
        last_refresh = 0.0
        while True:
            for line in log.lines():
                if status is not None:
                    status.console.print(line, markup=False, highlight=False, soft_wrap=True)
                else:
                    stream.write(line + "\n")
            stream.flush()
            lines = metrics.lines()
            if lines and status is not None:
                latest = _updated(latest, lines)
                if latest is not None:
                    status.update(progress_text(latest))
            now = time.monotonic()
            if now - last_refresh >= refresh_every_s:
                last_refresh = now
                job = refresh()
                if job.terminal:
                    time.sleep(POLL_S)
                    for line in log.lines():
                        stream.write(line + "\n")
                    stream.flush()
                    return job
            time.sleep(POLL_S)
    finally:
        if status is not None:
            status.stop()
