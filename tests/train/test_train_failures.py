"""When something is wrong, every rank ends promptly and the failing one says what and where."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.trainranks import DIGITS, Launch, Launcher, base_env, digits_config, write_config

pytestmark = pytest.mark.process

PROMPT_S = 15  # from the first rank's exit to the last one's


def _spread(launch: Launch) -> float:
    ends = [r.ended for r in launch.ranks if r.ended is not None]
    return max(ends) - min(ends)


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_factory_failing_on_one_rank_stops_all(launcher: Launcher, tmp_path: Path) -> None:
    config = digits_config(model="train_probe:build_model", model_args={"fail_on_rank": 1})
    launch = launcher.start(config, tmp_path / "run")
    codes = launch.wait(timeout=60)
    assert codes == [1, 1], launch.logs()
    assert _spread(launch) < PROMPT_S
    assert launch.ranks[1].stderr.strip().splitlines()[-1] == (
        "rank 1: model factory train_probe:build_model raised ValueError: no model for rank 1 "
        "(a test asked this rank to fail)"
    )
    assert "Traceback" in launch.ranks[1].stderr, "the user's traceback helps them fix it"
    assert launch.ranks[0].stderr.strip() == "rank 0: stopping: setup failed on rank(s) 1"


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_same_failure_everywhere_is_reported_once(launcher: Launcher, tmp_path: Path) -> None:
    launch = launcher.start(digits_config(model="digits:build_modle"), tmp_path / "run")
    assert launch.wait(timeout=60) == [2, 2], launch.logs()  # the job's mistake (issue #33)
    assert launch.ranks[0].stderr.strip() == (
        "rank 0: train.model: model factory digits has no attribute 'build_modle' "
        "(got digits:build_modle) (the same on rank(s) 1)\n"
        "  hint: name a function the module defines. did you mean 'build_model'?"
    )
    assert launch.ranks[1].stderr.strip() == ""


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_failure_mid_training_stops_all(launcher: Launcher, tmp_path: Path) -> None:
    """Rank 1 fails inside a step while rank 0 waits in the gradient all-reduce."""
    config = digits_config(
        dataset="train_probe:build_dataset",
        dataset_args={"fail_on_rank": 1, "fail_after": 100},
    )
    launch = launcher.start(config, tmp_path / "run")
    codes = launch.wait(timeout=60)
    assert codes == [1, 1], launch.logs()
    assert _spread(launch) < PROMPT_S
    last = launch.ranks[1].stderr.strip().splitlines()[-1]
    assert last.startswith("rank 1: training failed in epoch 1 after step 3: RuntimeError: sample")
    assert "another rank probably failed first" in launch.ranks[0].stderr
    assert launch.ranks[0].stderr.startswith("rank 0: training failed in epoch 1")


def _run_bare(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrate.train", *args], cwd=DIGITS, env=env,
        capture_output=True, text=True, timeout=60,
    )


def test_bad_environment_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = write_config(digits_config(), tmp_path / "config.json")
    env = base_env() | {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    started = time.monotonic()
    result = _run_bare(["--config", str(config)], env)
    assert result.returncode == 2
    assert result.stderr == (
        "orchestrate.train: environment: RANK: must be below WORLD_SIZE=2 (got 2)\n"
    )
    assert time.monotonic() - started < 20, "checked before importing torch"


def test_bad_config_exit_2(tmp_path: Path) -> None:
    bad = json.loads(write_config(digits_config(), tmp_path / "c.json").read_text())
    bad["epochz"] = 3
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    result = _run_bare(["--config", str(path)], base_env())
    assert result.returncode == 2
    assert f"{path}: epochz: unknown key" in result.stderr
    assert "did you mean 'epochs'?" in result.stderr
