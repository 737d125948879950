"""One line of ``metrics.jsonl``: what the built-in trainer's rank 0 reports, as one record.

The trainer (:mod:`orchestrate.train.trainer`, through :class:`orchestrate.train.metrics
.MetricsLog`) writes them; the supervisor (the first step's time, the step a restart resumed
from), ``submit --follow``'s progress line and the report read them. Each kind has its fields,
and a line holds exactly those (``null`` where the trainer had no value):

- ``start`` (after the first optimizer step of a process): epoch, step, time, world_size,
  resumed_from_step;
- ``step`` (every ``log_every_steps`` optimizer steps) and ``epoch`` (after each epoch's
  validation): epoch, step, train_loss, val_loss, val_accuracy, samples_per_s, epoch_s, lr,
  time, and peak_memory_gb (every rank's measured peak in GB: orchestrate/train/peakmemory.py);
- under ``global_batch_size``, ``start``, ``step`` and ``epoch`` also carry batch_shares (every
  rank's share of the global batch in force: ``batch_split: measured`` changes it);
- a ``start`` that resumed from an older checkpoint than the newest also carries passed_over:
  each newer checkpoint passed over and why (``step-00000300: shard ... is truncated``);
- ``shares`` (``batch_split: measured`` changed the split, before the next step): epoch, step,
  time, batch_shares;
- ``checkpoint`` (once a checkpoint is on disk): epoch, step, time, path;
- ``end`` (the process finishes or stops for a requeue): outcome, signal, epoch, step, time.

``epoch`` counts from 1, ``step`` is the optimizer step reached, ``time`` is ``time.time()``.
Reading is tolerant: a field that is missing or of the wrong type reads as None, and a line that
is not a record (no kind) as no record. Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

#: The fields of each kind, in the order a line holds them (after ``kind``).
KIND_FIELDS: dict[str, tuple[str, ...]] = {
    "start": ("epoch", "step", "time", "world_size", "resumed_from_step"),
    "step": ("epoch", "step", "train_loss", "val_loss", "val_accuracy", "samples_per_s",
             "epoch_s", "lr", "time"),
    "epoch": ("epoch", "step", "train_loss", "val_loss", "val_accuracy", "samples_per_s",
              "epoch_s", "lr", "time"),
    "shares": ("epoch", "step", "time"),
    "checkpoint": ("epoch", "step", "time", "path"),
    "end": ("outcome", "signal", "epoch", "step", "time"),
}
_INTS = ("epoch", "step", "world_size", "resumed_from_step")
_TEXTS = ("path", "outcome", "signal")


def finite(value: Any) -> float | None:
    """A finite number of a JSON document (a metrics line, the job record, the doctor's
    result), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _whole(value: Any) -> int | None:
    number = finite(value)
    return int(number) if number is not None and number == int(number) else None


@dataclass(frozen=True)
class MetricRecord:
    """One record of ``metrics.jsonl`` (see the module docstring for which kind has what)."""

    kind: str
    epoch: int | None = None
    step: int | None = None
    time: float | None = None
    train_loss: float | None = None
    val_loss: float | None = None
    val_accuracy: float | None = None
    samples_per_s: float | None = None
    epoch_s: float | None = None
    lr: float | None = None
    peak_memory_gb: tuple[float, ...] | None = None
    world_size: int | None = None
    resumed_from_step: int | None = None
    path: str | None = None
    outcome: str | None = None
    signal: str | None = None
    batch_shares: tuple[int, ...] | None = None  # start: every rank's share of a global batch
    passed_over: tuple[str, ...] | None = None  # start: newer checkpoints not whole, and why

    def carried(self) -> tuple[str, ...]:
        """The fields a line of this kind holds (an unknown kind: every field it has)."""
        known = KIND_FIELDS.get(self.kind)
        if known is None:
            return tuple(f.name for f in fields(self) if f.name != "kind"
                         and getattr(self, f.name) is not None)
        return known + tuple(name for name in ("peak_memory_gb", "batch_shares", "passed_over")
                             if getattr(self, name) is not None)

    def to_json(self) -> dict[str, Any]:
        """The line's JSON object."""
        out: dict[str, Any] = {"kind": self.kind}
        for name in self.carried():
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_json(cls, data: Any) -> MetricRecord | None:
        """The inverse of :meth:`to_json`, tolerant field by field; None without a kind."""
        if not isinstance(data, Mapping) or not isinstance(data.get("kind"), str):
            return None
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "kind" or f.name not in data:
                continue
            raw = data[f.name]
            if f.name in _INTS:
                values[f.name] = _whole(raw)
            elif f.name in _TEXTS:
                values[f.name] = raw if isinstance(raw, str) else None
            elif f.name == "peak_memory_gb":
                found = [finite(v) for v in raw] if isinstance(raw, list) else []
                values[f.name] = tuple(v for v in found if v is not None) if found else None
            elif f.name == "passed_over":
                texts = [str(v) for v in raw if isinstance(v, str)] if isinstance(raw, list) else []
                values[f.name] = tuple(texts) or None
            elif f.name == "batch_shares":
                whole = [_whole(v) for v in raw] if isinstance(raw, list) else []
                values[f.name] = tuple(v for v in whole if v is not None) or None
            else:
                values[f.name] = finite(raw)
        return cls(kind=data["kind"], **values)

    def updated(self, newer: MetricRecord) -> MetricRecord:
        """This record with every field ``newer`` carries taken from it (and its kind): the
        latest value of each, as a progress line shows them."""
        return replace(self, kind=newer.kind,
                       **{name: getattr(newer, name) for name in newer.carried()})
