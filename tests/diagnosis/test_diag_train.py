"""A ``train:`` job (``python -m orchestrate.train``): the trainer starts the sidecar itself (no
sitecustomize here), reports its phases and steps, and a rank stuck in its data loading is named.
"""

from __future__ import annotations

import json
import sys

import pytest

from orchestrate.core.spec.trainspec import TrainSpec
from tests.support.diagranks import DIGITS, PROGRAMS, REPO, Starter, drive

pytestmark = [pytest.mark.process, pytest.mark.torch]

STALL_S = 12.0
HEARTBEAT_S = 0.3


def _config(starter: Starter, after: int, workers: int = 0) -> str:
    spec = TrainSpec.model_validate({
        "num_workers": workers,
        "model": "digits:build_model", "model_args": {"hidden": 32},
        "dataset": "stuck_data:build_dataset", "dataset_args": {"stuck_rank": 1, "after": after},
        "optimizer": {"name": "adamw", "lr": 3.0e-3}, "epochs": 50, "batch_size": 32,
    })
    path = starter.tmp / "config.json"
    path.write_text(json.dumps(spec.model_dump(mode="json")))
    return str(path)


def test_train_job_names_the_rank_stuck_in_data_loading(starter: Starter) -> None:
    # 718 samples per rank and epoch: the 1500th read is in the third epoch
    config = _config(starter, after=1500)
    job = starter.start(
        [sys.executable, "-m", "orchestrate.train", "--config", config],
        2, name="train", site=False, python_path=[REPO, DIGITS, PROGRAMS], cwd=DIGITS,
        heartbeat_s=HEARTBEAT_S,
    )
    outcome = drive(job, stall_s=STALL_S, heartbeat_s=HEARTBEAT_S, deadline_s=180,
                    nodes={0: "node-a", 1: "node-b"}, capture="train")
    trigger = job.wait_mark("trigger")
    diagnosis = outcome.diagnosis
    assert diagnosis is not None, job.output()
    assert diagnosis.kind == "laggard", diagnosis.summary
    assert diagnosis.ranks == (1,) and diagnosis.nodes == ("node-b",)
    assert diagnosis.summary.startswith("rank 1 (node node-b) has not reached collective #"), (
        diagnosis.summary
    )
    assert "stuck_data.py:" in diagnosis.summary and "`__getitem__` (sleeping" in diagnosis.summary
    assert "; rank 0 waits in " in diagnosis.summary
    assert outcome.at is not None and outcome.at - trigger <= STALL_S + 30
    beats = {r: json.loads((job.run_dir / "diag" / "hb" / f"rank-{r}.json").read_text())
             for r in (0, 1)}
    assert beats[0]["phase"] == "step" and beats[0]["step"] > 40
    assert beats[1]["phase"] == "step"


def test_a_hung_dataloader_worker_is_named_with_its_stack(starter: Starter) -> None:
    """Issue #25 item 12: with ``num_workers: 2`` the stuck read is in a forked worker; the
    rank waits in torch's DataLoader. The diagnosis names that wait and the worker's place (its
    stack, collected by signalling the armed child), not only the trainer's loop."""
    # Each epoch's workers are forked from the rank with a fresh copy of the dataset: each
    # reads about 359 samples an epoch, so the 100th read of a worker is in the first epoch.
    config = _config(starter, after=100, workers=2)
    job = starter.start(
        [sys.executable, "-m", "orchestrate.train", "--config", config],
        2, name="loader", site=False, python_path=[REPO, DIGITS, PROGRAMS], cwd=DIGITS,
        heartbeat_s=HEARTBEAT_S,
    )
    outcome = drive(job, stall_s=STALL_S, heartbeat_s=HEARTBEAT_S, deadline_s=180,
                    nodes={0: "node-a", 1: "node-b"})
    job.wait_mark("trigger")
    diagnosis = outcome.diagnosis
    assert diagnosis is not None, job.output()
    assert diagnosis.kind == "laggard" and diagnosis.ranks == (1,), diagnosis.summary
    summary = diagnosis.summary
    assert summary.startswith("rank 1 (node node-b) has not reached collective #"), summary
    assert ", waiting for a DataLoader worker (worker pid " in summary, summary
    assert "is in stuck_data.py:" in summary and "`__getitem__`, sleeping" in summary, summary
    assert "; rank 0 waits in " in summary, summary
