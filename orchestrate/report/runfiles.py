"""Reading what a run left in its run directory, for the report, ``status`` and the live view.

Everything here tolerates absence and damage: a file that does not exist yet (a job still
starting, a backend or program that does not write it) is empty data, and a line cut short by a
writer that is still appending is skipped. Files and the shapes accepted:

- ``plan.json``: ``Plan.to_json()`` (read back with ``Plan.from_json``; a plan it cannot read is
  no plan); ``train.json``: the TrainSpec of ``train:`` jobs.
- ``metrics.jsonl``: rank 0's records (:class:`orchestrate.core.metricrecord.MetricRecord`):
  kinds start, step, epoch, checkpoint, end.
- ``timing/rank-<R>.jsonl``: each rank's step-timing windows (orchestrate/train/timing.py).
- ``diag/diagnosis.json``: the stall watch's verdict(s): one ``Diagnosis.to_json()`` object, a
  list of them, or ``{"diagnoses": [...]}``; a job record's ``"diagnosis"`` (``status --json``)
  is taken too. One without a kind, a summary or a time is skipped.
- ``attempts.json``: the runs of a restarted job: a list (or ``{"attempts": [...]}``) of
  ``orchestrate.core.plan.outcome.Attempt.to_json()``; a job record's ``"attempts"`` is taken
  too. Without it, restarts are still seen in metrics.jsonl (``start`` records with
  ``resumed_from_step``).
- ``doctor.json``: ``orchestrate doctor --json`` for the job; the report draws
  ``bandwidth.allreduce``: ``[{"size_bytes", "busbw_GBps", "algbw_GBps", "backend"}]`` (GB/s =
  1e9 bytes/s), ``bandwidth.expected``: ``{"low_GBps", "high_GBps"}`` or ``{"floor_GBps"}``
  (then the band is 50-100% of the floor: the doctor's pass range), and ``bandwidth.pairs``:
  ``{"nodes": [names], "GBps": [[row node -> column node, null on the diagonal]]}``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrate.core.layout import (
    ATTEMPTS_FILE,
    DOCTOR_FILE,
    METRICS,
    PLAN_FILE,
    REPORT_FILE,
    TIMING_DIR,
    TRAIN_CONFIG,
)
from orchestrate.core.metricrecord import MetricRecord
from orchestrate.core.plan.outcome import Attempt
from orchestrate.core.plan.plan import Plan
from orchestrate.diagnosis.diagfiles import DiagFiles
from orchestrate.diagnosis.stall import Diagnosis
from orchestrate.report.html import render_report
from orchestrate.report.rundata import RunData
from orchestrate.report.straggler import Pace, pace


def read_json(path: Path) -> Any:
    """The JSON value in ``path``, or None when it is missing or not (yet) valid."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file; lines that do not parse (a line being written,
    damage) are skipped."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    lines = [line for line in data.splitlines() if line.strip()]
    try:  # one parse of the whole file is ~3x faster than one per line
        values = json.loads(b"[" + b",".join(lines) + b"]")
        return [value for value in values if isinstance(value, dict)]
    except ValueError:
        pass
    records = []
    for line in lines:
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            records.append(value)
    return records


def read_timing(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Every rank's step-timing windows, by rank."""
    found: dict[int, list[dict[str, Any]]] = {}
    try:
        names = os.listdir(run_dir / TIMING_DIR)
    except OSError:
        return found
    for name in sorted(names):
        if not (name.startswith("rank-") and name.endswith(".jsonl")):
            continue
        try:
            rank = int(name[len("rank-"): -len(".jsonl")])
        except ValueError:
            continue
        found[rank] = read_jsonl(run_dir / TIMING_DIR / name)
    return found


def read_metrics(run_dir: Path) -> list[MetricRecord]:
    """The records of the run's ``metrics.jsonl`` (lines that are none are skipped)."""
    found = (MetricRecord.from_json(line) for line in read_jsonl(run_dir / METRICS))
    return [record for record in found if record is not None]


def read_plan(run_dir: Path) -> Plan | None:
    """The run's plan, or None (no plan.json, or one this version cannot read)."""
    data = read_json(run_dir / PLAN_FILE)
    try:
        return Plan.from_json(data) if isinstance(data, dict) else None
    except (KeyError, TypeError, ValueError):
        return None


def run_pace(run_dir: Path, nodes: Mapping[int, str], last_s: float | None = None) -> Pace:
    """Per-rank figures and the straggler from the run's timing files."""
    return pace(read_timing(run_dir), nodes, last_s=last_s)


def add_pace(status: dict[str, Any], run_dir: Path, last_s: float | None = None
             ) -> dict[str, Any]:
    """``status --json`` with ``"straggler"`` (null or ``{"rank", "node", "gap_pct"}``) and
    each entry of ``"ranks"`` given the rank's figures per step (null when it has none yet):
    data_s, forward_s, backward_s, optimizer_s, compute_s, sync_s, own_s, step_s, steps_per_s,
    samples_per_s, gap_pct, steps, samples, last_step, last_t (see
    orchestrate/report/straggler.py)."""
    nodes = {int(r["rank"]): str(r.get("node", "?")) for r in status.get("ranks") or []}
    figures = run_pace(run_dir, nodes, last_s)
    by_rank = figures.by_rank()
    status["straggler"] = None if figures.straggler is None else figures.straggler.to_json()
    for entry in status.get("ranks") or []:
        mine = by_rank.get(int(entry["rank"]))
        extra = mine.to_json() if mine is not None else None
        entry["timing"] = None if extra is None else {
            k: v for k, v in extra.items() if k not in ("rank", "node")
        }
    return status


def losses(records: Sequence[MetricRecord]) -> list[float]:
    """Training loss over the run: the logged steps' values, or the epochs' when steps were
    not logged."""
    for kind in ("step", "epoch"):
        values = [r.train_loss for r in records if r.kind == kind and r.train_loss is not None]
        if values:
            return values
    return []


def _listed(value: Any, key: str) -> list[Any]:
    """The objects of a list, of ``{key: [...]}``, or one object alone."""
    if isinstance(value, Mapping) and isinstance(value.get(key), list):
        value = value[key]
    items = value if isinstance(value, list) else [value] if isinstance(value, Mapping) else []
    return [item for item in items if isinstance(item, Mapping)]


def _stalls(value: Any) -> list[Diagnosis]:
    stalls = []
    for item in _listed(value, "diagnoses"):
        try:
            stalls.append(Diagnosis.from_json(item))
        except (KeyError, TypeError, ValueError):
            continue  # damaged: no kind, summary or time
    return stalls


def _attempts(value: Any) -> list[Attempt]:
    attempts = []
    for item in _listed(value, "attempts"):
        try:
            attempts.append(Attempt.from_json(dict(item)))
        except (KeyError, TypeError, ValueError):
            continue
    return attempts


def load_run(run_dir: Path, job_record_json: Mapping[str, Any] | None = None,
             *, now: float | None = None) -> RunData:
    """Everything the report shows, read from ``run_dir`` (and the job's record if given)."""
    plan = read_plan(run_dir)
    train = read_json(run_dir / TRAIN_CONFIG)
    job = dict(job_record_json) if job_record_json is not None else None
    stalls = _stalls(read_json(DiagFiles(run_dir).diagnosis))
    if not stalls and job is not None:
        stalls = _stalls(job.get("diagnosis"))
    attempts = _attempts(read_json(run_dir / ATTEMPTS_FILE))
    if not attempts and job is not None:
        attempts = _attempts(job.get("attempts"))
    doctor = read_json(run_dir / DOCTOR_FILE)
    job_id = str((job or {}).get("id") or (plan.job_id if plan else "") or run_dir.name)
    return RunData(
        job_id=job_id,
        plan=plan,
        job=job,
        train=train if isinstance(train, dict) else None,
        metrics=read_metrics(run_dir),
        timing=read_timing(run_dir),
        stalls=stalls,
        attempts=attempts,
        doctor=doctor if isinstance(doctor, dict) else None,
        generated_at=time.time() if now is None else now,
    )


def write_report(run_dir: Path, job_record_json: Mapping[str, Any] | None = None,
                 out: Path | None = None) -> Path:
    """Write the report of the run in ``run_dir`` to ``out`` (default
    ``<run_dir>/report.html``) and return its path; for the launcher at job end and for
    ``orchestrate report``. The file is replaced atomically (a reader never sees half)."""
    target = out if out is not None else run_dir / REPORT_FILE
    text = render_report(load_run(run_dir, job_record_json))
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, target)
    return target


__all__ = [
    "add_pace", "load_run", "losses", "read_json", "read_jsonl", "read_metrics", "read_plan",
    "read_timing", "run_pace", "write_report",
]
