"""The training jobs that a CPU test and its GPU twin (tests/train/test_train_gpu.py) both run:
the block model whose memory the plan estimates, with that estimate (test_train_memory.py), and
the digits job whose global batch is split into per-rank shares (test_train_shares.py). One
definition, so that the GPU tier checks the same jobs and no test module imports another."""

from __future__ import annotations

import os
from typing import Any

from orchestrate.core.plan.memory import GB, RankShape, rank_estimate
from orchestrate.core.spec.job import JobSpec
from orchestrate.train.modelfacts import probe
from tests.support.trainranks import TRAIN_TESTS, base_env

#: Three steps: the peak is reached in step 2 (the optimizer's state exists from step 1's
#: update on) and step 3 shows it held. 18 validation samples (1% of the digits, at least one
#: of each class): the end-of-run validation of this 67e6-parameter model over the default 20%
#: took longer than the steps (24 s of a 128 s FSDP run on a busy machine) and measures nothing.
TRAIN: dict[str, Any] = {
    "model": "train_probe:build_blocks", "model_args": {"width": 2896, "depth": 8},
    "dataset": "digits:build_dataset", "dataset_args": {"val_fraction": 0.01},
    "optimizer": {"name": "adamw", "lr": 1e-4},
    "batch_size": 16, "max_steps": 3, "log_every_steps": 1, "checkpoint_every_steps": 1000,
    "seed": 1,
}


def estimate_gb(strategy: str, world: int) -> tuple[float, str]:
    """The plan's per-rank estimate of :data:`TRAIN` under ``strategy`` on ``world`` CPU ranks
    (GB) and the method that made it."""
    job = JobSpec.model_validate({"name": "m", "backend": "local",
                                  "resources": {"nodes": 1},
                                  "train": TRAIN | {"strategy": strategy}})
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = base_env()["PYTHONPATH"]  # the factories' modules, as for ranks
    try:
        facts, note = probe(job, TRAIN_TESTS, "job.yaml")
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    assert facts is not None, note
    assert facts.params > 5e7
    option = strategy
    est = rank_estimate(job.train, facts, option, RankShape(world=world, gpu=False))  # type: ignore[arg-type]
    return est.total / GB, est.method


EPOCHS = 14  # 1,437 training samples // 64 = 22 steps an epoch: 308 steps


def shares_config(**overrides: Any) -> dict[str, Any]:
    """The digits job of the batch-share tests (``global_batch_size`` 64), with ``overrides``."""
    config: dict[str, Any] = {
        "model": "digits:build_model",
        "model_args": {"hidden": 64, "dropout": 0.0},
        "dataset": "digits:build_dataset",
        "optimizer": {"name": "adamw", "lr": 1.0e-3},
        "epochs": EPOCHS,
        "global_batch_size": 64,
        "seed": 3,
    }
    config.update(overrides)
    return config
