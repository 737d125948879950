"""What DDP must guarantee, checked from the user's side with three real ranks.

One run of the instrumented digits job (tests/train/train_probe.py) records, on every rank, the
weights at the first forward and at exit and every sample index read. From those:
- ``init_from`` with DDP's ``module.`` prefix loads on every rank;
- all ranks end with identical parameters;
- training shards are disjoint, reshuffled per epoch and exactly DistributedSampler's;
- validation covers every sample once, and its metrics equal a single-process evaluation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import digits
import pytest
import torch
from torch.utils.data import DistributedSampler

from tests.support.trainranks import Launch, Launcher

pytestmark = [pytest.mark.process, pytest.mark.torch]

WORLD = 3
EPOCHS = 2
VAL_SIZE = 100  # not a multiple of 3: uneven validation shards
SEED = 5


@pytest.fixture(scope="module")
def run(module_launcher: Launcher) -> tuple[Launch, dict[str, torch.Tensor]]:
    root = module_launcher.tmp_path / "ddp"
    record = root / "record"
    record.mkdir(parents=True)
    torch.manual_seed(1234)  # weights unlike the ones seed 5 would give
    pretrained = {f"module.{k}": v for k, v in digits.build_model(hidden=64).state_dict().items()}
    torch.save(pretrained, root / "pretrained.pt")
    config = {
        "model": "train_probe:build_model",
        "model_args": {"hidden": 64, "record_dir": str(record)},
        "dataset": "train_probe:build_dataset",
        "dataset_args": {"record_dir": str(record), "val_size": VAL_SIZE},
        "optimizer": {"name": "adamw", "lr": 3.0e-3},
        "epochs": EPOCHS,
        "batch_size": 32,
        "seed": SEED,
        "init_from": str(root / "pretrained.pt"),
    }
    launch = module_launcher.run(config, root / "run", nprocs=WORLD, timeout=150)
    return launch, pretrained


def _load(path: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return state


def _samples(launch: Launch, rank: int) -> dict[str, list[int]]:
    record = launch.run_dir.parent / "record"
    data: dict[str, list[int]] = json.loads((record / f"samples-rank{rank}.json").read_text())
    return data


@pytest.mark.timeout(240)
def test_init_from_with_module_prefix(run: tuple[Launch, dict[str, torch.Tensor]]) -> None:
    launch, pretrained = run
    record = launch.run_dir.parent / "record"
    for rank in range(WORLD):
        first = _load(record / f"first-rank{rank}.pt")
        assert first.keys() == {k.removeprefix("module.") for k in pretrained}
        for key, value in first.items():
            assert torch.equal(value, pretrained[f"module.{key}"]), (rank, key)


def test_parameters_identical_across_ranks(run: tuple[Launch, Any]) -> None:
    launch, _ = run
    record = launch.run_dir.parent / "record"
    finals = [_load(record / f"final-rank{rank}.pt") for rank in range(WORLD)]
    first = _load(record / "first-rank0.pt")
    for key in finals[0]:
        assert not torch.equal(finals[0][key], first[key]), f"{key} did not train"
        for rank in range(1, WORLD):
            assert torch.equal(finals[rank][key], finals[0][key]), (rank, key)
    saved = _load(launch.run_dir / "checkpoints" / "step-00000030.pt")
    saved_model: dict[str, torch.Tensor] = saved["model"]  # type: ignore[assignment]
    for key in finals[0]:
        assert torch.equal(saved_model[key], finals[0][key])


def test_training_shards_disjoint_and_reshuffled(run: tuple[Launch, Any]) -> None:
    launch, _ = run
    train_size = len(digits.build_dataset()[0])
    per_rank = train_size // WORLD
    logs = [_samples(launch, rank)["train"] for rank in range(WORLD)]
    assert all(len(log) == per_rank * EPOCHS for log in logs)
    for epoch in range(EPOCHS):
        shards = [log[epoch * per_rank:(epoch + 1) * per_rank] for log in logs]
        for rank, shard in enumerate(shards):
            sampler = DistributedSampler(
                range(train_size), num_replicas=WORLD, rank=rank, shuffle=True, seed=SEED,
                drop_last=True,
            )
            sampler.set_epoch(epoch)
            assert shard == list(sampler), f"rank {rank} epoch {epoch} order"
        union = [i for shard in shards for i in shard]
        assert len(set(union)) == len(union) == per_rank * WORLD, "shards overlap"
    assert logs[0][:per_rank] != logs[0][per_rank:], "not reshuffled between epochs"


def test_validation_exact(run: tuple[Launch, Any]) -> None:
    launch, _ = run
    seen = [_samples(launch, rank)["val"] for rank in range(WORLD)]
    # every epoch each rank evaluates its strided shard once: 34 + 33 + 33 samples
    assert [len(s) for s in seen] == [34 * EPOCHS, 33 * EPOCHS, 33 * EPOCHS]
    first_epoch = [s[: len(s) // EPOCHS] for s in seen]
    assert sorted(i for s in first_epoch for i in s) == list(range(VAL_SIZE))

    record = launch.run_dir.parent / "record"
    model = digits.build_model(hidden=64)
    model.load_state_dict(_load(record / "final-rank0.pt"))
    model.eval()
    val = digits.build_dataset()[1]
    inputs, target = val.tensors[0][:VAL_SIZE], val.tensors[1][:VAL_SIZE]
    with torch.no_grad():
        output = model(inputs)
    loss = torch.nn.functional.cross_entropy(output, target).item()
    correct = int((output.argmax(dim=1) == target).sum())
    last = [m for m in launch.metrics() if m["kind"] == "epoch"][-1]
    assert last["val_accuracy"] == correct / VAL_SIZE
    assert last["val_loss"] == pytest.approx(loss, rel=1e-6)
