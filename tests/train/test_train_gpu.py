"""The sharded and split training on real GPUs (skipped, with the reason, where there are none).

The same checks as the CPU tests, with nccl on up to two GPUs: FSDP trains the block model to
COMPLETED and the plan's traced estimate is within 15% of each rank's
``torch.cuda.max_memory_allocated`` (the measured peak in metrics.jsonl; the CUDA context and
NCCL's buffers are outside both); unequal batch shares end with one process's parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import latest_weights
from tests.support.gpus import GPUS, needs_gpu
from tests.support.trainjobs import TRAIN, estimate_gb, shares_config
from tests.support.trainranks import Launcher

pytestmark = [pytest.mark.gpu, pytest.mark.torch, pytest.mark.timeout(600)]

WORLD = min(2, GPUS) or 1


@needs_gpu("FSDP on nccl and the CUDA peak need one")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_cuda_peak_within_15_percent_of_the_estimate(
    launcher: Launcher, tmp_path: Path, strategy: str
) -> None:
    launch = launcher.run(TRAIN | {"strategy": strategy}, tmp_path / strategy, nprocs=WORLD,
                          timeout=400)
    assert launch.metrics()[-1]["outcome"] == "completed"
    expected, method = estimate_gb(strategy, WORLD)
    assert method == "traced"
    steps = [m for m in launch.metrics() if m["kind"] == "step"]
    for rank, peak in enumerate(steps[-1]["peak_memory_gb"]):
        assert abs(peak - expected) <= 0.15 * peak, (strategy, rank, peak, expected)


@needs_gpu("shares on nccl need GPUs")
def test_shares_on_gpus_end_with_one_process_parameters(launcher: Launcher, tmp_path: Path
                                                        ) -> None:
    if WORLD < 2:
        pytest.skip("one GPU: no split to compare (needs 2)")
    launcher.run(shares_config(epochs=3), tmp_path / "one", nprocs=1, timeout=300)
    launcher.run(shares_config(epochs=3, batch_shares=[48, 16]), tmp_path / "split",
                 nprocs=2, timeout=300)
    one, split = latest_weights(tmp_path / "one"), latest_weights(tmp_path / "split")
    for key, value in one.items():
        assert torch.allclose(split[key], value, atol=1e-4, rtol=0), key
