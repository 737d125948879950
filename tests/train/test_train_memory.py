"""The plan's memory estimate against what the ranks measured, on real gloo ranks.

A 67e6-parameter block model (AdamW, fp32) trains a few steps on 2 CPU ranks under DDP and
under FSDP; each rank reports its measured peak in ``metrics.jsonl`` (resident memory above its
baseline just before the model was built: orchestrate/train/peakmemory.py). The planner's
traced estimate of the same layout, world size and batch (orchestrate/train/modelfacts.py)
must be within 15% of every rank's measurement. The GPU tier checks the same against
``torch.cuda.max_memory_allocated`` (tests/train/test_train_gpu.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.trainjobs import TRAIN, estimate_gb
from tests.support.trainranks import Launcher

pytestmark = [pytest.mark.process, pytest.mark.torch]

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
