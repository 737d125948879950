"""The run data model of the report: what a run left, as typed records, and what is derived from
them (each rank's node, the metrics of the final history, the step at a moment, the restarts).

:func:`orchestrate.report.runfiles.load_run` reads a run directory into a :class:`RunData`;
:mod:`orchestrate.report.html` lays it out. Pure: values in, values out.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrate.core.metricrecord import MetricRecord
from orchestrate.core.plan.outcome import Attempt
from orchestrate.core.plan.plan import Plan
from orchestrate.diagnosis.stall import Diagnosis


@dataclass(frozen=True)
class RunData:
    """Everything the report shows, as read from a run directory (missing parts are empty)."""

    job_id: str
    plan: Plan | None = None  # plan.json
    job: Mapping[str, Any] | None = None  # JobRecord.to_json() when known
    train: Mapping[str, Any] | None = None  # train.json (TrainSpec) for train: jobs
    metrics: Sequence[MetricRecord] = ()
    timing: Mapping[int, Sequence[Mapping[str, Any]]] = field(default_factory=dict)
    stalls: Sequence[Diagnosis] = ()  # what the stall watch diagnosed
    attempts: Sequence[Attempt] = ()  # the runs of a restarted job
    doctor: Mapping[str, Any] | None = None  # orchestrate doctor --json
    generated_at: float | None = None


def rank_nodes(plan: Plan | None) -> dict[int, str]:
    """Each rank's node name."""
    return {} if plan is None else {r.rank: r.node for r in plan.ranks}


def effective_metrics(records: Sequence[MetricRecord]) -> list[MetricRecord]:
    """The metrics records that describe the run's final history: after a restart resumed
    from step S, the records of steps after S from the attempt that died are dropped (the
    resumed attempt redid those steps)."""
    kept: list[MetricRecord] = []
    for record in records:
        resumed = record.resumed_from_step
        if record.kind == "start" and resumed is not None:
            kept = [r for r in kept if (r.step or 0) <= resumed or r.kind == "start"]
        kept.append(record)
    return kept


def metric_points(records: Sequence[MetricRecord], kind: str,
                  value: Callable[[MetricRecord], float | None]) -> list[tuple[float, float]]:
    """(step, value) of every ``kind`` record that has a step and a ``value``."""
    points = []
    for r in records:
        if r.kind != kind or r.step is None:
            continue
        found = value(r)
        if found is not None:
            points.append((float(r.step), found))
    return points


def step_at(records: Sequence[MetricRecord], t: float) -> float | None:
    """The optimizer step reached at wall-clock ``t`` (linear between logged records)."""
    timed = sorted((r.time, float(r.step)) for r in records
                   if r.time is not None and r.step is not None)
    if not timed:
        return None
    if t <= timed[0][0]:
        return timed[0][1]
    for (t0, s0), (t1, s1) in itertools.pairwise(timed):
        if t0 <= t <= t1:
            return s0 + (s1 - s0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
    return timed[-1][1]


def restarts(data: RunData) -> list[tuple[float, str]]:
    """(step, label) of every restart: attempts after the first, and metrics ``start`` records
    that resumed from a checkpoint."""
    found: dict[float, str] = {}
    for a in data.attempts:
        if a.n > 1 and a.resumed_from_step is not None:
            found[float(a.resumed_from_step)] = f"restart {a.n}"
    count = 1
    for r in data.metrics:
        if r.kind == "start" and r.resumed_from_step is not None:
            count += 1
            found.setdefault(float(r.resumed_from_step), f"restart {count}")
    return sorted(found.items())
