"""``strategy: fsdp`` on real gloo ranks: it trains, checkpoints in shards, resumes, exports.

Each claim is checked against what a user would compare: the weights ``orchestrate export``
writes from an FSDP run equal those of the same job under DDP (the same global batches: FSDP
averages the same gradients, only the summation order differs), a sharded checkpoint resumes on
the same world size bit-identically and on another world size with the loss carrying on.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrate.run.attemptmetrics import older_resumes
from tests.support.trainranks import REPO, Launch, Launcher, base_env

pytestmark = [pytest.mark.process, pytest.mark.torch]


def _config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model": "train_probe:build_blocks",
        "model_args": {"width": 67, "depth": 3},
        "dataset": "digits:build_dataset",
        "optimizer": {"name": "adamw", "lr": 3.0e-3, "weight_decay": 0.01},
        "epochs": 2,
        "batch_size": 32,
        "grad_clip_norm": 1.0,
        "checkpoint_every_steps": 10,
        "seed": 21,
    }
    config.update(overrides)
    return config


def _export(source: Path, output: Path, *extra: str) -> dict[str, torch.Tensor]:
    """``orchestrate export`` as a user runs it; the plain state dict it wrote."""
    done = subprocess.run(
        [sys.executable, "-m", "orchestrate", "export", str(source), "-o", str(output), *extra],
        capture_output=True, text=True, env=base_env(), cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    state: dict[str, torch.Tensor] = torch.load(output, weights_only=True)
    return state


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=tol, rtol=0), (
            key, float((a[key] - b[key]).abs().max()))


def _end(launch: Launch) -> dict[str, Any]:
    end = launch.metrics()[-1]
    assert end["kind"] == "end", end
    return end


@pytest.fixture(scope="module")
def ddp(module_launcher: Launcher) -> Path:
    """The reference: the same job under DDP on 2 ranks."""
    run_dir = module_launcher.tmp_path / "ddp"
    module_launcher.run(_config(), run_dir, timeout=150)
    return run_dir


@pytest.fixture(scope="module")
def fsdp_straight(module_launcher: Launcher) -> Launch:
    """The job under FSDP on 2 ranks, start to end: the 2-rank case of the DDP comparison and
    the straight run the sharded resume must end on (one run, read by both; neither writes
    into its run folder)."""
    run_dir = module_launcher.tmp_path / "fsdp-straight"
    return module_launcher.run(_config(strategy="fsdp"), run_dir, timeout=200)


@pytest.fixture(scope="module")
def fsdp_at_17(module_launcher: Launcher) -> Path:
    """The same FSDP job on 2 ranks stopped at ``max_steps: 17`` (sharded checkpoints at steps
    10 and 17: the default ``keep_checkpoints``, 3, keeps both). Each test resumes or cuts a
    copy of its run folder (:func:`_copy`): one run where each test ran the same one."""
    run_dir = module_launcher.tmp_path / "fsdp-at-17"
    module_launcher.run(_config(strategy="fsdp") | {"max_steps": 17}, run_dir, timeout=200)
    return run_dir


def _copy(run_dir: Path, to: Path) -> Path:
    """A copy of a finished run's folder, resumed as the run itself would be."""
    shutil.copytree(run_dir, to, symlinks=True)
    return to


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_completes_and_exports_the_ddp_weights(
    ddp: Path, launcher: Launcher, tmp_path: Path, world: int, request: pytest.FixtureRequest
) -> None:
    if world == 2:
        launch: Launch = request.getfixturevalue("fsdp_straight")
    else:
        launch = launcher.run(_config(strategy="fsdp"), tmp_path / "fsdp", nprocs=world,
                              timeout=200)
    run_dir = launch.run_dir
    assert _end(launch)["outcome"] == "completed"
    assert "strategy fsdp" in launch.ranks[0].stdout
    assert "FSDP units: Block" in launch.ranks[0].stdout
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "checkpoints" / latest / ".metadata").is_file(), "a sharded checkpoint"
    exported = _export(run_dir, tmp_path / "fsdp.pt")
    assert not any(k.startswith("module.") for k in exported)
    if world == 2:  # the same global batches as the DDP reference
        _close(exported, _export(ddp, tmp_path / "ddp.pt"), 1e-4)
    accuracy = [m for m in launch.metrics() if m["kind"] == "epoch"][-1]["val_accuracy"]
    assert accuracy > 0.8


def _digits() -> dict[str, Any]:
    return {
        "model": "digits:build_model",
        "model_args": {"hidden": 64, "dropout": 0.0},
        "dataset": "digits:build_dataset",
        "optimizer": {"name": "adamw", "lr": 3.0e-3},
        "epochs": 3,
        "batch_size": 32,
        "seed": 5,
    }


@pytest.mark.timeout(300)
def test_fsdp_digits_equals_ddp_digits(launcher: Launcher, tmp_path: Path) -> None:
    """The digits example itself (an nn.Sequential without repeated blocks: one unit)."""
    sharded = launcher.run(_digits() | {"strategy": "fsdp"}, tmp_path / "fsdp", timeout=150)
    assert _end(sharded)["outcome"] == "completed"
    launcher.run(_digits(), tmp_path / "ddp", timeout=150)
    _close(_export(tmp_path / "fsdp", tmp_path / "a.pt"),
           _export(tmp_path / "ddp", tmp_path / "b.pt"), 1e-4)


@pytest.mark.timeout(400)
def test_sharded_resume_same_world_is_exact_and_other_world_continues(
    fsdp_straight: Launch, fsdp_at_17: Path, launcher: Launcher, tmp_path: Path
) -> None:
    config = _config(strategy="fsdp")
    total = _end(fsdp_straight)["step"]
    reference = _export(fsdp_straight.run_dir, tmp_path / "straight.pt")

    run_dir = _copy(fsdp_at_17, tmp_path / "resumed")
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000017"
    second = launcher.run(config, run_dir, timeout=200)
    assert second.metrics()[0]["resumed_from_step"] == 17
    assert _end(second)["step"] == total
    _close(_export(run_dir, tmp_path / "resumed.pt"), reference, 0.0)

    other = _copy(fsdp_at_17, tmp_path / "other")
    before = _export(other, tmp_path / "at17.pt")
    third = launcher.run(config | {"max_steps": 30}, other, nprocs=3, timeout=200)
    assert third.metrics()[0]["resumed_from_step"] == 17
    assert "resuming from" in third.ranks[0].stdout
    after = _export(other, tmp_path / "at17-again.pt", "--step", "17")
    _close(after, before, 0.0)  # the 2-rank checkpoint, read back the same
    losses = [m["train_loss"] for m in third.metrics() if m["kind"] == "epoch"]
    assert losses and all(loss < 1.0 for loss in losses), losses  # carries on, not from scratch


@pytest.mark.timeout(400)
def test_a_truncated_shard_is_named_and_resume_takes_the_checkpoint_before(
    fsdp_at_17: Path, launcher: Launcher, tmp_path: Path
) -> None:
    """Issue #33 item 7: ``export`` names the file cut short (no traceback); a resume passes
    over that checkpoint for the newest complete one, saying so."""
    config = _config(strategy="fsdp")
    run_dir = _copy(fsdp_at_17, tmp_path / "cut")  # checkpoints: 10 and 17
    newest = run_dir / "checkpoints" / "step-00000017"
    shard = newest / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    done = subprocess.run(
        [sys.executable, "-m", "orchestrate", "export", str(newest), "-o",
         str(tmp_path / "w.pt")], capture_output=True, text=True, env=base_env(), cwd=REPO,
        timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "shard __1_0.distcp is truncated" in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "orchestrate", "export", str(run_dir), "-o",
         str(tmp_path / "w.pt")], capture_output=True, text=True, env=base_env(), cwd=REPO,
        timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "passed over checkpoint step-00000017: shard __1_0.distcp" in done.stderr
    assert done.stdout.strip().endswith("step-00000010")
    resumed = launcher.run(config | {"max_steps": 20}, run_dir, timeout=200)
    assert resumed.metrics()[0]["resumed_from_step"] == 10
    assert "checkpoint step-00000017: shard __1_0.distcp is truncated" in resumed.ranks[0].stdout
    # status and the summary say the resume went back (orchestrate/run/attemptmetrics.py)
    (passed,) = resumed.metrics()[0]["passed_over"]
    assert passed.startswith("step-00000017: shard __1_0.distcp is truncated"), passed
    (said,) = older_resumes(run_dir)
    assert said.startswith("start 2 resumed from step 10, an older checkpoint: the newer were "
                           "not whole (step-00000017: shard __1_0.distcp is truncated"), said
    assert _end(resumed)["step"] == 20
