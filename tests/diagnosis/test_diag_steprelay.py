"""The step relay (orchestrate/diagnosis/steprelay.py): a program that is not Python writes a
JSON line per step to ``$ORCHESTRATE_STEP_FILE`` and gets what ``report`` gives a Python one.
Units with a fake clock; then real shell programs under ``python -m orchestrate_steps``, from
the sidecar folder a launcher makes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrate.diagnosis.steprelay import Relay, StepLines, step_of
from orchestrate.diagnosis.stepreport import LossNotFinite, StepReporter
from tests.support.diagranks import install_site

pytestmark = pytest.mark.unit


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_line_is_the_reports_arguments() -> None:
    assert step_of('{"step": 3, "loss": 0.25, "samples": 32, "t": 1700000000.5}') == {
        "step": 3, "loss": 0.25, "samples": 32, "at": 1700000000.5}
    assert step_of('{"step": "4", "loss": "nan", "backward_s": 0.1}')["loss"] != 0  # type: ignore[index]
    for bad in ("step 3 loss 0.2", '{"loss": 1}', '{"step": 1, "loss": "x"}', "[1, 2]"):
        assert step_of(bad) is None, bad


def test_a_line_still_being_written_waits_for_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    lines = StepLines(str(path))
    assert lines.read() == []  # not there yet
    path.write_text('{"step": 1, "loss": 1}\n{"step": 2, ')
    assert lines.read() == ['{"step": 1, "loss": 1}']
    with path.open("a") as handle:
        handle.write('"loss": 0.5}\n')
    assert lines.read() == ['{"step": 2, "loss": 0.5}']


def test_the_relay_reports_each_line_at_its_time_and_names_a_bad_one_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(f'{{"step": {s}, "loss": {1 / s}, "samples": 4, "t": {10 + s / 2}}}\n'
                            for s in range(1, 5)) + "oops\nnope\n")
    car = StepReporter(str(tmp_path), 0, 2, window_s=100.0, clock=lambda: 99.0)
    Relay(str(path), car).pump()
    car.flush()
    steps = [m for m in _lines(tmp_path / "metrics.jsonl") if m["kind"] == "step"]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert steps[-1]["samples_per_s"] == pytest.approx(8.0)  # 4 samples in 0.5 s, from "t"
    (window,) = _lines(tmp_path / "timing" / "rank-0.jsonl")
    assert window["steps"] == 3 and window["wall_s"] == pytest.approx(1.5)
    assert capsys.readouterr().err.count("not a step record") == 1
    path.write_text('{"step": 5, "loss": NaN}\n')
    relay = Relay(str(path), StepReporter(str(tmp_path), 1, 2, clock=lambda: 0.0))
    with pytest.raises(LossNotFinite):
        relay.pump()


SHELL_STEPS = """
i=1
while [ "$i" -le "${STEPS:-5}" ]; do
  loss=0.5
  if [ -n "$NAN_AT" ] && [ "$i" -ge "$NAN_AT" ]; then loss='"nan"'; fi
  echo "{\\"step\\": $i, \\"loss\\": $loss, \\"samples\\": 8}" >> "$ORCHESTRATE_STEP_FILE"
  i=$((i + 1))
  sleep 0.05
done
exit "${EXIT:-0}"
"""


def _relay(tmp_path: Path, rank: int, **env: str) -> subprocess.CompletedProcess[str]:
    site = install_site(tmp_path / "sidecar")
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    environ = {"PATH": os.environ["PATH"], "PYTHONPATH": str(site), "RANK": str(rank),
               "WORLD_SIZE": "2", "ORCHESTRATE_RUN_DIR": str(run_dir), **env}
    return subprocess.run([sys.executable, "-m", "orchestrate_steps", "--", "sh", "-c",
                           SHELL_STEPS], env=environ, capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.mark.process
def test_a_shell_programs_steps_become_the_curve_and_its_exit_the_ranks(tmp_path: Path) -> None:
    done = _relay(tmp_path, 0, EXIT="3")
    assert done.returncode == 3, done.stderr  # the rank ends as its program did
    run_dir = tmp_path / "run"
    steps = [m for m in _lines(run_dir / "metrics.jsonl") if m["kind"] == "step"]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]
    assert sum(int(str(w["steps"])) for w in _lines(run_dir / "timing" / "rank-0.jsonl")) == 4
    assert (run_dir / "steps" / "rank-0.jsonl").is_file()


@pytest.mark.process
def test_a_shell_programs_nan_loss_stops_it_with_the_trainers_sentence(tmp_path: Path) -> None:
    started = time.monotonic()
    done = _relay(tmp_path, 1, STEPS="2000", NAN_AT="3")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "rank 1: the loss is not finite (nan) at step 3; training stopped (lower the learning "
        "rate, clip the gradients, or check the data)")
    assert time.monotonic() - started < 30  # stopped, not its 2000 steps (100 s)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # rank 1 writes no curve


@pytest.mark.process
def test_a_program_that_cannot_run_is_named_and_usage_without_one(tmp_path: Path) -> None:
    site = install_site(tmp_path / "sidecar")
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(site)}
    missing = subprocess.run([sys.executable, "-m", "orchestrate_steps", "--", "no-such-prog"],
                             env=env, capture_output=True, text=True, timeout=60, check=False)
    assert missing.returncode == 127
    assert "orchestrate step relay: cannot run no-such-prog" in missing.stderr
    usage = subprocess.run([sys.executable, "-m", "orchestrate_steps"], env=env,
                           capture_output=True, text=True, timeout=60, check=False)
    assert usage.returncode == 2 and "usage: python -m orchestrate_steps" in usage.stderr
