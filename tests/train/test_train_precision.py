"""Precision, accumulation, schedule and loss options, each in a short single-rank run.

To pay for ``import torch`` once, one subprocess runs the entrypoint's ``main()`` for every
configuration in turn (a single process, no launcher variables: world size 1) and reports each
exit status and stderr.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrate.core.spec.trainspec import SchedulerSpec
from orchestrate.train.optimizer import lr_factor
from tests.support.trainranks import DIGITS, base_env, digits_config, write_config

pytestmark = [pytest.mark.process, pytest.mark.torch]

RUNNER = """
import contextlib, io, json, sys
from orchestrate.train.main import main
results = {}
for name, config, run_dir in json.loads(sys.argv[1]):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(["--config", config, "--run-dir", run_dir])
    results[name] = {"code": code, "stderr": err.getvalue(), "stdout": out.getvalue()}
print(json.dumps(results))
"""

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.0}
PLAIN = {"hidden": 32, "dropout": 0.0}
CONFIGS: dict[str, dict[str, Any]] = {
    "bf16": digits_config(precision="bf16", max_steps=4),
    "bf16-true": digits_config(precision="bf16-true", max_steps=4),
    "fp16": digits_config(precision="fp16", max_steps=4),
    "batch32": digits_config(model_args=PLAIN, optimizer=SGD, batch_size=32, max_steps=3),
    "accum2x16": digits_config(
        model_args=PLAIN, optimizer=SGD, batch_size=16, grad_accum_steps=2, max_steps=3
    ),
    "cosine": digits_config(
        scheduler={"name": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1},
        max_steps=6, log_every_steps=1, optimizer={"name": "adamw", "lr": 0.01},
    ),
    "custom-loss": digits_config(loss="train_probe:mean_abs_error", epochs=1),
    "missing-loss": digits_config(loss="train_probe:nope", epochs=1),
    "no-val-workers-tensorboard": digits_config(
        dataset="train_probe:build_dataset", dataset_args={"without_val": True},
        num_workers=1, epochs=2, tensorboard=True,
    ),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("precision")
    jobs = [
        (name, str(write_config(config, root / f"{name}.json")), str(root / name))
        for name, config in CONFIGS.items()
    ]
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(jobs)], cwd=DIGITS, env=base_env(),
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    for name, _, run_dir in jobs:
        found[name]["run_dir"] = Path(run_dir)
    return found


def _checkpoint(result: dict[str, Any]) -> dict[str, Any]:
    directory = result["run_dir"] / "checkpoints"
    state: dict[str, Any] = torch.load(
        directory / (directory / "latest").read_text().strip(), weights_only=True
    )
    return state


def _metrics(result: dict[str, Any]) -> list[dict[str, Any]]:
    lines = (result["run_dir"] / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.timeout(300)
def test_bf16_autocast(results: dict[str, Any]) -> None:
    result = results["bf16"]
    assert result["code"] == 0, result["stderr"]
    state = _checkpoint(result)
    assert state["step"] == 4
    assert all(v.dtype == torch.float32 for v in state["model"].values())
    epochs = [m for m in _metrics(result) if m["kind"] == "epoch"]
    assert epochs[-1]["train_loss"] < 2.4  # finite, and below chance level ln(10)


def test_bf16_true_keeps_weights_and_optimizer_in_bf16(results: dict[str, Any]) -> None:
    result = results["bf16-true"]
    assert result["code"] == 0, result["stderr"]
    state = _checkpoint(result)
    assert all(v.dtype == torch.bfloat16 for v in state["model"].values())
    moments = state["optimizer"]["state"][0]
    assert moments["exp_avg"].dtype == torch.bfloat16


def test_fp16_on_cpu_is_refused_clearly(results: dict[str, Any]) -> None:
    result = results["fp16"]
    assert result["code"] == 2
    assert "precision: fp16 mixed precision needs CUDA GPUs" in result["stderr"]
    assert "hint: use bf16 or fp32 on CPUs" in result["stderr"]


def test_accumulating_two_halves_equals_one_batch(results: dict[str, Any]) -> None:
    whole, halves = results["batch32"], results["accum2x16"]
    assert whole["code"] == 0 and halves["code"] == 0, halves["stderr"]
    a, b = _checkpoint(whole), _checkpoint(halves)
    assert a["step"] == b["step"] == 3
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=1e-5, atol=1e-6)


def test_scheduler_is_stepped_per_optimizer_step(results: dict[str, Any]) -> None:
    result = results["cosine"]
    assert result["code"] == 0, result["stderr"]
    spec = SchedulerSpec(name="cosine", warmup_steps=2, min_lr_ratio=0.1)
    steps = [m for m in _metrics(result) if m["kind"] == "step"]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5, 6]
    for record in steps:  # the rate the next step will use
        assert record["lr"] == pytest.approx(0.01 * lr_factor(spec, record["step"], 6))
    assert steps[-1]["lr"] == pytest.approx(0.001)


def test_custom_loss_and_a_missing_one(results: dict[str, Any]) -> None:
    assert results["custom-loss"]["code"] == 0, results["custom-loss"]["stderr"]
    missing = results["missing-loss"]
    assert missing["code"] == 2  # the job's mistake (issue #33)
    assert missing["stderr"].strip().splitlines()[0] == (
        "rank 0: train.loss: loss train_probe has no attribute 'nope' (got train_probe:nope)"
    )


def test_without_validation_with_workers_and_no_tensorboard(results: dict[str, Any]) -> None:
    result = results["no-val-workers-tensorboard"]
    assert result["code"] == 0, result["stderr"]
    assert "tensorboard: asked for but not installed" in result["stdout"]
    epochs = [m for m in _metrics(result) if m["kind"] == "epoch"]
    assert [(m["val_loss"], m["val_accuracy"]) for m in epochs] == [(None, None)] * 2
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]


def test_autocast_keeps_no_weight_copies_under_activation_checkpointing() -> None:
    # autocast's cache would keep every weight's bf16 copy through the forward pass, which
    # checkpointing exists to avoid (issue #34: 13.6 -> 1.7 GB traced on a LLaMA-7B shape)
    from orchestrate.core.spec.trainspec import TrainSpec
    from orchestrate.train.precision import plan_precision

    spec = TrainSpec(model="m:f", dataset="d:f", precision="bf16-mixed")
    cpu = torch.device("cpu")
    assert plan_precision(spec, cpu).cache
    for setting in (True, ["Block"]):
        plan = plan_precision(spec.model_copy(update={"activation_checkpointing": setting}), cpu)
        assert not plan.cache
        with plan.autocast():
            assert not torch.is_autocast_cache_enabled()
