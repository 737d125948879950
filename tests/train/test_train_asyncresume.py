"""Checkpoints written in the background (``checkpoint_async``, the default), on real gloo ranks.

What a user relies on: a rank killed while a checkpoint is still being written in the background
resumes from the last complete one and ends bit-identical to a run that was never interrupted;
a stop signal that arrives while a write is in flight waits for it, so every checkpoint the run
announced is on disk, whole, before the ranks exit 75. The model is digits' MLP made wide (about
13 MB a checkpoint with AdamW's moments) and checkpointed every step, so a write is in flight
much of the time.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrate.train.partwrite import leaves
from tests.support.trainranks import Launch, Launcher

pytestmark = [pytest.mark.process, pytest.mark.torch]

WIDE: dict[str, Any] = {
    "model": "digits:build_model",
    "model_args": {"hidden": 1024},
    "dataset": "digits:build_dataset",
    "epochs": 1,
    "max_steps": 8,
    "batch_size": 32,
    "checkpoint_every_steps": 1,
    "keep_checkpoints": 2,
    "seed": 5,
}
BLOCKS: dict[str, Any] = {
    "model": "train_probe:build_blocks",
    "model_args": {"width": 512, "depth": 4},
    "dataset": "digits:build_dataset",
    "strategy": "fsdp",
    "epochs": 1,
    "batch_size": 32,
    "checkpoint_every_steps": 1,
    "keep_checkpoints": 2,
}


def _temporary(directory: Path) -> Path | None:
    """A checkpoint being written (after a first one is complete), if there is one now."""
    if not (directory / "latest").exists():
        return None
    for entry in os.scandir(directory):
        if entry.name.startswith(".step-") and ".tmp-" in entry.name:
            return Path(entry.path)
    return None


def _catch_a_write(launch: Launch, directory: Path) -> Path | None:
    """Wait until a background write is in flight (None if the run ended first)."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and launch.ranks[0].proc.poll() is None:
        found = _temporary(directory)
        if found is not None:
            return found
        time.sleep(0.0005)
    return None


def _step_of(name: str) -> int:
    return int(name.strip().lstrip(".").split(".")[0].removeprefix("step-"))


@pytest.mark.timeout(300)
def test_sigkill_during_a_background_save_resumes_from_the_last_complete_one_bit_identical(
    launcher: Launcher, tmp_path: Path
) -> None:
    straight = launcher.run(WIDE, tmp_path / "straight")
    # Both ranks see one checkpoint folder: each writes a share of every checkpoint.
    assert "written in the background (one at a time, each in shares by ranks 0, 1)" in \
        straight.ranks[0].stdout
    for attempt in range(3):
        run_dir = tmp_path / f"killed{attempt}"
        directory = run_dir / "checkpoints"
        launch = launcher.start(WIDE, run_dir)
        temporary = _catch_a_write(launch, directory)
        if temporary is not None:
            launch.signal(0, signal.SIGKILL)
        launch.kill()
        if temporary is not None and temporary.exists():
            break
    else:
        pytest.fail("never caught rank 0 in the middle of a background write")
    latest = (directory / "latest").read_text().strip()
    assert _step_of(temporary.name) > _step_of(latest), "latest names only complete ones"

    rerun = launcher.run(WIDE, run_dir)
    assert rerun.metrics()[0]["resumed_from_step"] == _step_of(latest)
    assert not temporary.exists(), "the torn temporary is cleaned up"
    final = torch.load(directory / "step-00000008.pt", weights_only=True)
    reference = torch.load(straight.run_dir / "checkpoints" / "step-00000008.pt",
                           weights_only=True)
    for key, value in reference["model"].items():
        assert torch.equal(final["model"][key], value), f"parameter {key} differs"
    for index, moments in reference["optimizer"]["state"].items():
        for name, value in moments.items():
            assert torch.equal(final["optimizer"]["state"][index][name], value), (index, name)


@pytest.mark.timeout(240)
@pytest.mark.skipif(os.geteuid() != 0, reason="a rank in its own mount namespace needs root")
def test_a_rank_that_sees_another_checkpoint_folder_writes_no_share_and_the_file_is_whole(
    launcher: Launcher, tmp_path: Path
) -> None:
    # Rank 1's checkpoint_dir is a tmpfs of its own (a host without the shared folder): rank 0
    # writes every checkpoint alone, and it is the one the ranks in shares write.
    config = WIDE | {"max_steps": 4}
    shared = launcher.run(config | {"checkpoint_dir": str(tmp_path / "shared")},
                          tmp_path / "shares")
    assert "in shares by ranks 0, 1" in shared.ranks[0].stdout
    folder = tmp_path / "apart"
    folder.mkdir()
    own = ["unshare", "--mount", "--", "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"',
           str(folder)]
    apart = launcher.run(config | {"checkpoint_dir": str(folder)}, tmp_path / "apart-run",
                         prefix={1: own})
    said = apart.ranks[0].stdout
    assert "written in the background (one at a time)" in said and "in shares" not in said
    assert (folder / "latest").read_text().strip() == "step-00000004.pt"
    alone = torch.load(folder / "step-00000004.pt", weights_only=True)
    both = torch.load(tmp_path / "shared" / "step-00000004.pt", weights_only=True)
    for part in ("model", "optimizer"):
        for (key, want), (_, got) in zip(leaves(both[part]), leaves(alone[part]), strict=True):
            assert torch.equal(want, got), (part, key)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("config", [WIDE | {"max_steps": None}, BLOCKS], ids=["ddp", "fsdp"])
def test_a_stop_during_a_background_save_waits_for_it(
    config: dict[str, Any], launcher: Launcher, tmp_path: Path
) -> None:
    run_dir = tmp_path / "stopped"
    directory = run_dir / "checkpoints"
    launch = launcher.start(config, run_dir)
    assert _catch_a_write(launch, directory) is not None, launch.logs()
    launch.signal(1, signal.SIGTERM)
    assert launch.wait(timeout=90) == [75, 75], launch.logs()
    end = launch.metrics()[-1]
    assert (end["kind"], end["outcome"]) == ("end", "preempted")
    assert (directory / "latest").read_text().strip().startswith(f"step-{end['step']:08d}")
    # Every checkpoint was announced (none lost with the process), the one in flight included,
    # and nothing is left half-written.
    saved = [m["step"] for m in launch.metrics() if m["kind"] == "checkpoint"]
    assert saved == list(range(1, end["step"] + 1)), launch.ranks[0].stdout
    assert not [p for p in directory.iterdir() if ".tmp-" in p.name]
    for path in directory.iterdir():
        if path.name.startswith("step-") and path.suffix == ".pt":
            assert torch.load(path, weights_only=True)["step"] == _step_of(path.name)


@pytest.mark.timeout(240)
def test_wandb_offline_logs_every_attempt_of_a_job_as_one_run(
    launcher: Launcher, tmp_path: Path
) -> None:
    """wandb comes with the test extras (tests/setup.sh); offline, it talks to no server, and
    its settings and cache stay in the test's folder."""
    pytest.importorskip("wandb")
    run_dir = tmp_path / "tracked"
    home = tmp_path / "wandb-home"
    config = {"model": "digits:build_model", "dataset": "digits:build_dataset",
              "epochs": 1, "max_steps": 3, "log_every_steps": 1, "wandb": True}
    for attempt in (1, 2):  # W&B is rank 0's: one rank shows it (and costs half the time)
        launcher.run(config | {"max_steps": 3 * attempt}, run_dir, timeout=150, nprocs=1,
                     env={"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                          "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true",
                          "WANDB_CONFIG_DIR": str(home / "config"),
                          "WANDB_CACHE_DIR": str(home / "cache"),
                          "WANDB_DATA_DIR": str(home / "data"),
                          "ORCHESTRATE_JOB_ID": "digits-20261205-ab12",
                          "ORCHESTRATE_ATTEMPT": str(attempt)})
    runs = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith("-digits-20261205-ab12") for name in runs), runs
