"""What an attempt's metrics file tells the supervisor: when the first step was done (``status``
shows it), which step the trainer resumed from (the attempts table), and whether that was an
older checkpoint than the newest, the newer ones not being whole (``status`` and the summary
say so: otherwise a resume that went back hundreds of steps looks like any other).

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


def older_resumes(run_dir: Path) -> list[str]:
    """A sentence for each start of the trainer that passed over newer checkpoints (a file cut
    short, a shard missing), numbered by start: ``start 2 resumed from step 200, an older
    checkpoint: the newer were not whole (step-00000300: ... is truncated)``."""
    try:
        lines = (run_dir / METRICS).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    found: list[str] = []
    starts = 0
    for line in lines:
        try:
            record = MetricRecord.from_json(json.loads(line))
        except ValueError:
            continue
        if record is None or record.kind != "start":
            continue
        starts += 1
        if not record.passed_over:
            continue
        why = "; ".join(record.passed_over)
        if record.resumed_from_step is None:
            found.append(f"start {starts} began from scratch: no checkpoint was whole ({why})")
        else:
            found.append(f"start {starts} resumed from step {record.resumed_from_step}, an "
                         f"older checkpoint: the newer were not whole ({why})")
    return found


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

