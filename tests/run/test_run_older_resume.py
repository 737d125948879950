"""A resume that went back past newer checkpoints that were not whole is said by ``status``, its
``--json`` and the summary, not only as a smaller number in the attempts table (issue #33): the
trainer's ``start`` record carries what it passed over (orchestrate/core/metricrecord.py), read
back by orchestrate/run/attemptmetrics.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrate.core.metricrecord import MetricRecord
from orchestrate.run.attemptmetrics import older_resumes, resumed_from

pytestmark = pytest.mark.unit

CUT = "step-00000300: shard __1_0.distcp is truncated (1,024 of 2,048 bytes)"


def _metrics(run_dir: Path, *records: MetricRecord) -> None:
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(r.to_json()) + "\n" for r in records) + "{not json\n")


def test_a_start_that_passed_over_newer_checkpoints_is_said_and_others_are_not(
        tmp_path: Path) -> None:
    first = MetricRecord("start", epoch=1, step=1, time=1.0, world_size=2)
    older = MetricRecord("start", epoch=3, step=201, time=2.0, world_size=2,
                         resumed_from_step=200, passed_over=(CUT,))
    assert "passed_over" not in first.to_json()  # a line holds it only when it has it
    assert MetricRecord.from_json(older.to_json()) == older
    _metrics(tmp_path, first, MetricRecord("step", step=5, train_loss=1.0), older)
    assert resumed_from(tmp_path) == 200
    assert older_resumes(tmp_path) == [
        f"start 2 resumed from step 200, an older checkpoint: the newer were not whole ({CUT})"]


def test_no_whole_checkpoint_at_all_says_it_began_from_scratch(tmp_path: Path) -> None:
    _metrics(tmp_path, MetricRecord("start", step=1, passed_over=(CUT, "step-00000200.pt: x")))
    assert older_resumes(tmp_path) == [
        f"start 1 began from scratch: no checkpoint was whole ({CUT}; step-00000200.pt: x)"]
    assert older_resumes(tmp_path / "missing") == []
    bad = MetricRecord.from_json({"kind": "start", "passed_over": "not a list"})
    assert bad is not None and bad.passed_over is None
