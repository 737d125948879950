"""The plan's memory estimate against what the ranks measured, on real gloo ranks.

A 67e6-parameter block model (AdamW, fp32) trains a few steps on 2 CPU ranks under DDP and
under FSDP; each rank reports its measured peak in ``metrics.jsonl`` (resident memory above its
baseline just before the model was built: orchestrate/train/peakmemory.py). The planner's
traced estimate of the same layout, world size and batch (orchestrate/train/modelfacts.py)
must be within 15% of every rank's measurement. The GPU tier checks the same against
``torch.cuda.max_memory_allocated`` (tests/train/test_train_gpu.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from orchestrate.core.plan.memory import GB, RankShape, rank_estimate
from orchestrate.core.spec.job import JobSpec
from orchestrate.train.modelfacts import probe
from tests.support.trainranks import TRAIN_TESTS, Launcher, base_env

pytestmark = [pytest.mark.process, pytest.mark.torch]

TRAIN: dict[str, Any] = {
    "model": "train_probe:build_blocks", "model_args": {"width": 2896, "depth": 8},
    "dataset": "digits:build_dataset", "optimizer": {"name": "adamw", "lr": 1e-4},
    "batch_size": 16, "max_steps": 4, "log_every_steps": 1, "checkpoint_every_steps": 1000,
    "seed": 1,
}


def estimate_gb(strategy: str, world: int) -> tuple[float, str]:
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


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_estimate_within_15_percent_of_measured_peak(
    launcher: Launcher, tmp_path: Path, strategy: str
) -> None:
    expected, method = estimate_gb(strategy, 2)
    assert method == "traced"
    launch = launcher.run(TRAIN | {"strategy": strategy}, tmp_path / strategy, timeout=300)
    steps = [m for m in launch.metrics() if m["kind"] == "step"]
    measured = steps[-1]["peak_memory_gb"]
    assert len(measured) == 2
    for rank, peak in enumerate(measured):
        assert abs(peak - expected) <= 0.15 * peak, (strategy, rank, peak, expected)
