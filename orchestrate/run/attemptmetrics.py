"""What an attempt's metrics file tells the supervisor: when the first step was done (``status``
shows it) and which step the trainer resumed from (the attempts table).

Read from ``metrics.jsonl`` (:data:`orchestrate.core.layout.METRICS`) rather than asked of the
ranks, so it holds for every backend's ranks and for a rank that already ended.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from orchestrate.core.layout import METRICS
from orchestrate.core.metricrecord import MetricRecord
from orchestrate.run.store import Store


def resumed_from(run_dir: Path) -> int | None:
    """The step the last attempt's trainer resumed from (its latest metrics "start" record)."""
    try:
        lines = (run_dir / METRICS).read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = MetricRecord.from_json(json.loads(line))
        except ValueError:
            continue
        if record is not None and record.kind == "start":
            return record.resumed_from_step
    return None


def record_first_step(store: Store, job_id: str, metrics: Path) -> bool:
    """Record when the first step's metrics line was written; whether there was one."""
    try:
        first = metrics.read_text(encoding="utf-8").splitlines()[:1]
        if not first:
            return False
        record = MetricRecord.from_json(json.loads(first[0]))
    except (OSError, ValueError):
        return False
    if record is None:
        return False
    stamp = record.time if record.time is not None else time.time()
    store.update(job_id, first_step_at=stamp)
    return True

