"""The step reporter of ``command:`` programs (orchestrate/diagnosis/stepreport.py): it writes
the trainer's own records (read back with the readers the report and the live view use), splits
the time it is told about, and stops a rank on a loss that is not finite. Units: a fake clock,
files in a temporary run dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrate.core.metricrecord import KIND_FIELDS, MetricRecord
from orchestrate.diagnosis import stepreport
from orchestrate.diagnosis.stepreport import LossNotFinite, StepReporter
from orchestrate.report.straggler import pace

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rank_0_writes_the_trainers_records_and_every_rank_its_timing(tmp_path: Path) -> None:
    clock = Clock()
    zero = StepReporter(str(tmp_path), 0, 2, window_s=1.0, clock=clock)
    one = StepReporter(str(tmp_path), 1, 2, window_s=1.0, clock=clock)
    for step in range(1, 6):
        zero.report(step, 1.0 / step, samples=8, backward_s=0.05)
        one.report(step, 2.0 / step, samples=8, backward_s=0.25)  # waited for rank 0
        clock.now += 0.5
    zero.flush()
    one.flush()
    records = [MetricRecord.from_json(line) for line in _lines(tmp_path / "metrics.jsonl")]
    assert [r.kind for r in records if r] == ["start"] + ["step"] * 5
    for line in _lines(tmp_path / "metrics.jsonl"):  # exactly the trainer's fields
        assert sorted(line) == sorted(("kind", *KIND_FIELDS[str(line["kind"])])), line
    last = records[-1]
    assert last is not None and last.step == 5 and last.train_loss == pytest.approx(0.2)
    assert last.samples_per_s == pytest.approx(16.0)  # 8 samples a step, a step in 0.5 s
    assert not (tmp_path / "metrics.jsonl").read_text().count('"train_loss": 2.0')  # rank 1's
    windows = {r: _lines(tmp_path / "timing" / f"rank-{r}.jsonl") for r in (0, 1)}
    assert sum(int(str(w["steps"])) for w in windows[1]) == 4
    figures = pace(windows, {0: "h1", 1: "h2"})  # the report's own reading
    by = figures.by_rank()
    assert by[1].sync_s == pytest.approx(0.2) and by[0].sync_s == 0.0
    # Rank 1 waited 0.2 s a step in backward for rank 0: rank 0 is the straggler.
    assert by[0].own_s == pytest.approx(0.5) and by[1].own_s == pytest.approx(0.3)
    assert figures.straggler is not None and figures.straggler.rank == 0


def test_a_loss_that_is_not_finite_stops_the_rank_with_the_sentence(tmp_path: Path) -> None:
    car = StepReporter(str(tmp_path), 3, 4, clock=Clock())
    car.report(1, 0.5, samples=4)
    with pytest.raises(LossNotFinite) as stopped:
        car.report(2, float("nan"), samples=4)
    assert stopped.value.code == ("rank 3: the loss is not finite (nan) at step 2; training "
                                  "stopped (lower the learning rate, clip the gradients, or "
                                  "check the data)")
    with pytest.raises(SystemExit):  # what the program sees: exit status 1, no traceback
        car.report(3, float("inf"))


def test_a_run_dir_that_refuses_files_is_said_once_and_never_raises(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    car = StepReporter(str(blocked), 0, 1, window_s=0.0, clock=Clock())
    for step in range(1, 4):
        car.report(step, 1.0)
    assert capsys.readouterr().err.count("cannot write") == 1


def test_the_rank_comes_from_the_environment_without_a_process_group(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(stepreport, "_reporters", {})
    made = stepreport.reporter({"RANK": "2", "WORLD_SIZE": "4",
                                "ORCHESTRATE_RUN_DIR": str(tmp_path)})
    assert (made.rank, made.world_size, made.run_dir) == (2, 4, str(tmp_path))
    assert stepreport.reporter() is made  # one a process
