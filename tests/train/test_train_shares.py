"""Unequal per-rank batches (``global_batch_size`` split into shares) give one big batch's
gradients: the same job split [48, 16], [32, 32] and run as one process on the same global
batches of 64 ends with the same parameters after several hundred optimizer steps (DDP, and
FSDP for [48, 16]). A share list that does not fit the ranks stops every rank with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.checkpoints import latest_weights
from tests.support.trainjobs import EPOCHS, shares_config
from tests.support.trainranks import Launcher

pytestmark = [pytest.mark.process, pytest.mark.torch]



def _steps(run_dir: Path) -> int:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return int(latest.removeprefix("step-").removesuffix(".pt"))


@pytest.mark.timeout(600)
def test_splits_end_with_the_parameters_of_one_process(launcher: Launcher, tmp_path: Path
                                                       ) -> None:
    single = tmp_path / "single"
    launcher.run(shares_config(), single, nprocs=1, timeout=240)
    reference = latest_weights(single)
    assert _steps(single) == EPOCHS * (1437 // 64)
    runs = {"48-16": shares_config(batch_shares=[48, 16]), "32-32": shares_config(),
            "fsdp-48-16": shares_config(batch_shares=[48, 16], strategy="fsdp")}
    for name, config in runs.items():
        launch = launcher.run(config, tmp_path / name, timeout=240)
        assert _steps(tmp_path / name) == _steps(single), name
        shares = [48, 16] if "48" in name else [32, 32]
        start = next(m for m in launch.metrics() if m["kind"] == "start")
        assert start["batch_shares"] == shares, start
        epochs = [m for m in launch.metrics() if m["kind"] == "epoch"]
        assert len(epochs) == EPOCHS and all(m["batch_shares"] == shares for m in epochs)
        assert f"batch shares {shares} of global_batch_size 64" in launch.ranks[0].stdout
        got = latest_weights(tmp_path / name)
        assert got.keys() == reference.keys()
        for key, value in reference.items():
            diff = float((got[key] - value).abs().max())
            assert diff <= 1e-5, (name, key, diff)


@pytest.mark.timeout(400)
def test_per_sample_weights_give_the_weighted_mean_of_the_global_batch(
        launcher: Launcher, tmp_path: Path) -> None:
    """A dataset yielding (input, target, weight): each rank's loss is scaled by its share of
    the step's weight, so [48, 16] ends where one process on the weighted global batch ends,
    and where ignoring the weights would not."""
    weighted = shares_config(dataset="train_probe:build_weighted", epochs=4)
    single = tmp_path / "single"
    launcher.run(weighted, single, nprocs=1, timeout=240)
    reference = latest_weights(single)
    launcher.run({**weighted, "batch_shares": [48, 16]}, tmp_path / "split", timeout=240)
    got = latest_weights(tmp_path / "split")
    for key, value in reference.items():
        diff = float((got[key] - value).abs().max())
        assert diff <= 1e-5, (key, diff)
    launcher.run(shares_config(epochs=4), tmp_path / "unweighted", nprocs=1, timeout=240)
    plain = latest_weights(tmp_path / "unweighted")
    assert max(float((plain[k] - v).abs().max()) for k, v in reference.items()) > 1e-3


@pytest.mark.timeout(120)
def test_shares_that_do_not_fit_the_ranks_stop_every_rank(launcher: Launcher, tmp_path: Path
                                                          ) -> None:
    launch = launcher.start(shares_config(batch_shares=[40, 16, 8]), tmp_path / "bad")
    codes = launch.wait(timeout=90)
    assert all(code != 0 for code in codes), codes
    assert "do not split global_batch_size 64 over 2 ranks" in launch.logs()
