"""The digits example, exactly as examples/digits/job.yaml states it, on two CPU ranks."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.support.trainranks import DIGITS, Launch, Launcher

pytestmark = [pytest.mark.process, pytest.mark.torch]

EPOCH_KEYS = {
    "kind", "epoch", "step", "train_loss", "val_loss", "val_accuracy", "samples_per_s",
    "epoch_s", "time",
}


@pytest.fixture(scope="module")
def example(module_launcher: Launcher) -> tuple[Launch, float]:
    train = yaml.safe_load((DIGITS / "job.yaml").read_text())["train"]
    started = time.monotonic()
    launch = module_launcher.run(train, module_launcher.tmp_path / "example", timeout=120)
    return launch, time.monotonic() - started


def _epochs(launch: Launch) -> list[dict[str, Any]]:
    return [m for m in launch.metrics() if m["kind"] == "epoch"]


@pytest.mark.timing
@pytest.mark.timeout(180)
def test_example_converges_quickly(example: tuple[Launch, float]) -> None:
    launch, seconds = example
    epochs = _epochs(launch)
    assert [m["epoch"] for m in epochs] == list(range(1, 9))
    assert epochs[-1]["val_accuracy"] >= 0.93, epochs[-1]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    assert seconds < 60, f"two ranks took {seconds:.1f} s"


def test_metrics_file_and_stdout(example: tuple[Launch, float]) -> None:
    launch, _ = example
    records = launch.metrics()
    assert records[0]["kind"] == "start"
    assert records[0]["step"] == 1 and records[0]["world_size"] == 2
    assert records[-1]["kind"] == "end" and records[-1]["outcome"] == "completed"
    for record in _epochs(launch):
        assert record.keys() >= EPOCH_KEYS
        assert record["samples_per_s"] > 0 and record["epoch_s"] > 0
        # CPU ranks report their measured peak too (issue #24): one figure per rank, in GB
        peaks = record["peak_memory_gb"]
        assert len(peaks) == 2 and all(0 <= p < 4 for p in peaks), peaks
        assert "batch_shares" not in record  # a per-rank batch_size: no global batch split
    times = [r["time"] for r in records]
    assert times == sorted(times)
    # 1437 training samples / 2 ranks = 718 each (one left out), 23 batches of 32 per epoch
    assert [r["step"] for r in _epochs(launch)] == [23 * i for i in range(1, 9)]
    lines = [ln for ln in launch.ranks[0].stdout.splitlines() if ln.startswith("epoch ")]
    assert [ln.split()[1] for ln in lines] == [f"{i}/8" for i in range(1, 9)]
    assert "val_acc" in lines[-1]
    assert "epoch " not in launch.ranks[1].stdout, "only rank 0 reports"


def test_checkpoint_layout(example: tuple[Launch, float]) -> None:
    launch, _ = example
    directory = launch.run_dir / "checkpoints"
    names = sorted(p.name for p in directory.iterdir())
    # keep_checkpoints defaults to 3; one checkpoint per epoch (checkpoint_every_steps: 0)
    assert names == ["latest", "step-00000138.pt", "step-00000161.pt", "step-00000184.pt"]
    assert (directory / "latest").read_text().strip() == "step-00000184.pt"
    state = torch.load(directory / "step-00000184.pt", weights_only=True)
    assert not any(key.startswith("module.") for key in state["model"])
    assert (state["epoch"], state["batch_in_epoch"], state["step"]) == (8, 0, 184)
    assert len(state["ranks"]) == 2
    assert {"python", "numpy", "torch"} <= state["ranks"][1]["rng"].keys()
    assert state["optimizer"]["state"], "AdamW moments are saved"
    assert state["config"]["seed"] == 777


def test_rerun_of_a_finished_job_does_nothing(
    example: tuple[Launch, float], module_launcher: Launcher
) -> None:
    """A requeue after the job finished must not train again."""
    launch, _ = example
    directory: Path = launch.run_dir / "checkpoints"
    before = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    train = yaml.safe_load((DIGITS / "job.yaml").read_text())["train"]
    again = module_launcher.run(train, launch.run_dir, timeout=120)
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == before
    assert again.metrics()[-1] == {**again.metrics()[-1], "kind": "end", "step": 184}
    assert "resuming from" in again.ranks[0].stdout
