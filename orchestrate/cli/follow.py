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
from typing import IO, Any

from orchestrate.core.layout import MERGED_LOG, METRICS
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


def progress_text(metrics: dict[str, Any]) -> str:
    """One status line from the latest metrics record."""
    parts = []
    for key, fmt in (("epoch", "epoch {}"), ("step", "step {}"),
                     ("train_loss", "loss {:.4g}"), ("val_accuracy", "val acc {:.3f}"),
                     ("samples_per_s", "{:.0f} samples/s")):
        value = metrics.get(key)
        if value is not None:
            try:
                parts.append(fmt.format(value))
            except (ValueError, TypeError):
                continue
    return " | ".join(parts)


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
    latest: dict[str, Any] = {}
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
            records = metrics.lines()
            if records and status is not None:
                for record in records:  # later records update what earlier ones said
                    with contextlib.suppress(ValueError, TypeError):
                        latest.update(json.loads(record))
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
