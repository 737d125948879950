"""Stopping and resuming: a resumed run ends exactly where an uninterrupted one does.

The job has dropout (RNG state matters), gradient accumulation with a short last group, a warmup
schedule, and checkpoints every 5 optimizer steps, so a stop lands mid-epoch. 718 samples per
rank in batches of 32 are 23 batches, 12 optimizer steps per epoch, 48 in 4 epochs.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.trainranks import Launch, Launcher

pytestmark = [pytest.mark.process, pytest.mark.torch]

TOTAL_STEPS = 48


def _config(**dataset_args: Any) -> dict[str, Any]:
    return {
        "model": "train_probe:build_model",
        "model_args": {"hidden": 64, "dropout": 0.2},
        "dataset": "train_probe:build_dataset",
        "dataset_args": dataset_args,
        "optimizer": {"name": "adamw", "lr": 3.0e-3, "weight_decay": 0.01},
        "scheduler": {"name": "constant", "warmup_steps": 6},
        "epochs": 4,
        "batch_size": 32,
        "grad_accum_steps": 2,
        "grad_clip_norm": 1.0,
        "checkpoint_every_steps": 5,
        "seed": 11,
    }


def _final(run_dir: Path, step: int = TOTAL_STEPS) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(
        run_dir / "checkpoints" / f"step-{step:08d}.pt", weights_only=True
    )
    return state


def _assert_same_training(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), f"parameter {key} differs"
    for index, moments in a["optimizer"]["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, b["optimizer"]["state"][index][name]), (index, name)
    assert a["scheduler"] == b["scheduler"]


def _epoch_lines(launch: Launch) -> dict[int, dict[str, Any]]:
    return {m["epoch"]: m for m in launch.metrics() if m["kind"] == "epoch"}


@pytest.fixture(scope="module")
def straight(module_launcher: Launcher) -> Launch:
    """Four epochs without interruption: the reference."""
    return module_launcher.run(_config(), module_launcher.tmp_path / "straight", timeout=120)


@pytest.mark.timeout(240)
def test_max_steps_stop_then_resume_is_bit_identical(
    straight: Launch, launcher: Launcher, tmp_path: Path
) -> None:
    run_dir = tmp_path / "resumed"
    # First part under Slurm's variables only (no RANK/WORLD_SIZE): the same job.
    first = launcher.run({**_config(), "max_steps": 17}, run_dir, slurm=True)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000017.pt"
    stopped = _final(run_dir, 17)
    assert (stopped["epoch"], stopped["batch_in_epoch"]) == (1, 10), "mid-epoch 2"
    assert first.metrics()[-1]["outcome"] == "completed"

    second = launcher.run(_config(), run_dir)
    assert "resuming from" in second.ranks[0].stdout
    assert second.metrics()[0]["resumed_from_step"] == 17
    _assert_same_training(_final(run_dir), _final(straight.run_dir))
    reference, resumed = _epoch_lines(straight), _epoch_lines(second)
    assert sorted(resumed) == [2, 3, 4]
    for epoch in (2, 3, 4):
        assert resumed[epoch]["val_loss"] == reference[epoch]["val_loss"]
        assert resumed[epoch]["train_loss"] == pytest.approx(reference[epoch]["train_loss"],
                                                              rel=1e-12)


@pytest.mark.timeout(240)
def test_sigterm_checkpoints_exits_75_and_rerun_completes(
    straight: Launch, launcher: Launcher, tmp_path: Path
) -> None:
    run_dir = tmp_path / "preempted"
    slow = _config(delay_s=0.002)  # about 1.5 s per epoch: time to be interrupted
    launch = launcher.start(slow, run_dir)
    launch.wait_for_metric("start")
    time.sleep(1.0)
    launch.signal(1, signal.SIGTERM)  # one rank is enough: the flag is all-reduced
    signalled = time.monotonic()
    codes = launch.wait(timeout=60)
    assert codes == [75, 75], launch.logs()
    assert time.monotonic() - signalled < 15
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    step = int(latest.removeprefix("step-").removesuffix(".pt"))
    assert 0 < step < TOTAL_STEPS
    end = launch.metrics()[-1]
    assert (end["kind"], end["outcome"], end["step"]) == ("end", "preempted", step)
    assert "exiting 75" in launch.ranks[0].stdout

    rerun = launcher.run(slow | {"dataset_args": {}}, run_dir)
    assert rerun.metrics()[0]["resumed_from_step"] == step
    _assert_same_training(_final(run_dir), _final(straight.run_dir))
