"""What rank 0 reports: ``metrics.jsonl`` for programs, one line per epoch for people.

``<run_dir>/metrics.jsonl`` gets one :class:`~orchestrate.core.metricrecord.MetricRecord` per
line (its kinds and fields are described there), appended and flushed as it happens; the
launcher takes its "first step" time from the first (``start``) record.

TensorBoard and Weights & Biases get the same numbers when the job asks for them *and* they are
installed (one run per job across its attempts: :mod:`orchestrate.train.tracking`); a missing
one is a note on stdout, never a failure.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrate.core.layout import METRICS
from orchestrate.core.metricrecord import MetricRecord
from orchestrate.core.spec.trainspec import TrainSpec
from orchestrate.train.tracking import open_tensorboard, open_wandb, tracking_for


def format_epoch(record: MetricRecord, epochs: int) -> str:
    """The human line for an epoch record."""
    parts = [f"epoch {record.epoch}/{epochs}", f"step {record.step}"]
    if record.train_loss is not None:
        parts.append(f"train_loss {record.train_loss:.4f}")
    if record.val_loss is not None:
        parts.append(f"val_loss {record.val_loss:.4f}")
    if record.val_accuracy is not None:
        parts.append(f"val_acc {record.val_accuracy:.4f}")
    if record.samples_per_s is not None:
        parts.append(f"{record.samples_per_s:.0f} samples/s")
    if record.epoch_s is not None:
        parts.append(f"{record.epoch_s:.2f} s")
    if record.peak_memory_gb:
        parts.append("peak " + "/".join(f"{gb:.1f}" for gb in record.peak_memory_gb) + " GB")
    return "  ".join(parts)


class MetricsLog:
    """Rank 0's metrics sinks; on other ranks every method does nothing."""

    def __init__(self, run_dir: Path, spec: TrainSpec, *, enabled: bool) -> None:
        self.enabled = enabled
        self.path = run_dir / METRICS
        self._epochs = spec.epochs
        self._spec = spec
        self._tensorboard: Any = None
        self._wandb: Any = None
        # A checkpoint written in the background is announced from its writer's thread.
        self._lock = threading.Lock()

    def open_trackers(self, environ: Mapping[str, str], resumed_from: int | None) -> None:
        """Open TensorBoard and W&B when the job asks for them (rank 0, once set up: the job's
        one run, resumed; :mod:`orchestrate.train.tracking`)."""
        if not self.enabled or not (self._spec.tensorboard or self._spec.wandb):
            return
        run_dir = self.path.parent
        track = tracking_for(run_dir, environ)
        if self._spec.tensorboard:
            self._tensorboard = open_tensorboard(track, run_dir, resumed_from)
        if self._spec.wandb:
            self._wandb = open_wandb(track, run_dir, self._spec)

    def say(self, text: str) -> None:
        """Print a line for people (rank 0 only), flushed at once so logs stay live."""
        if self.enabled:
            with self._lock:
                print(text, flush=True)

    def record(self, record: MetricRecord) -> None:
        """Append ``record`` to metrics.jsonl and forward its numbers."""
        if not self.enabled:
            return
        with self._lock:
            self._record(record)

    def _record(self, record: MetricRecord) -> None:
        line = record.to_json()
        with open(self.path, "a", encoding="utf-8") as handle:
            # Strict JSON: a NaN or infinite number is written as null, never as bare NaN.
            handle.write(json.dumps(_finite(line), allow_nan=False) + "\n")
        if record.kind == "epoch":
            print(format_epoch(record, self._epochs), flush=True)
        numbers = {
            key: value
            for key, value in line.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
            and key not in ("epoch", "step", "time")
        }
        step = record.step or 0
        prefix = "epoch" if record.kind == "epoch" else "train"
        if self._tensorboard is not None and record.kind in ("epoch", "step"):
            for key, value in numbers.items():
                self._tensorboard.add_scalar(f"{prefix}/{key}", value, step)
            self._tensorboard.flush()
        if self._wandb is not None and record.kind in ("epoch", "step"):
            self._wandb.log({f"{prefix}/{k}": v for k, v in numbers.items()}, step=step)

    def close(self) -> None:
        """Flush and close the optional sinks."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
