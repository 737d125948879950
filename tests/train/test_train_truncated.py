"""A checkpoint cut short (a full disk, a copy stopped half-way) is named by its file, and the
newest whole one is used instead (issue #33 item 7); no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from orchestrate.train import checkpoint
from orchestrate.train.export import export
from orchestrate.train.failure import TrainFailure

pytestmark = [pytest.mark.unit, pytest.mark.torch,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _sharded(directory: Path, step: int) -> Path:
    """A sharded checkpoint as one process writes it (the layout of orchestrate.train.distcp)."""
    path = directory / checkpoint.name_for(step, sharded=True)
    model = torch.nn.Linear(64, 64)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
    torch.save({"position": step}, path / checkpoint.SIDE)
    checkpoint.point_latest(directory, path)
    return path


def _cut(path: Path) -> int:
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)
    return size


def test_a_truncated_shard_is_named_and_the_one_before_it_is_used(tmp_path: Path) -> None:
    older = _sharded(tmp_path, 10)
    newer = _sharded(tmp_path, 20)
    assert checkpoint.incomplete(newer) is None
    size = _cut(newer / "__0_0.distcp")
    why = f"shard __0_0.distcp is truncated ({size // 2:,} of {size:,} bytes)"
    assert checkpoint.incomplete(newer) == why
    skipped: list[str] = []
    assert checkpoint.find_latest(tmp_path, skipped) == older
    assert skipped == [f"step-00000020: {why}"]
    with pytest.raises(TrainFailure) as caught:
        export(newer, tmp_path / "out.pt")
    assert str(caught.value) == f"cannot read checkpoint {newer}: {why}"
    passed: list[str] = []
    assert export(tmp_path, tmp_path / "out.pt", None, passed)[0] == older
    assert passed == skipped


def test_a_truncated_file_or_side_file_is_passed_over_too(tmp_path: Path) -> None:
    whole = checkpoint.save({"position": 1}, tmp_path, 1, keep=5)
    cut = checkpoint.save({"position": 2, "pad": torch.zeros(4096)}, tmp_path, 2, keep=5)
    _cut(cut)
    skipped: list[str] = []
    assert checkpoint.find_latest(tmp_path, skipped) == whole
    assert skipped == ["step-00000002.pt: step-00000002.pt is truncated or not a checkpoint"]
    sharded = _sharded(tmp_path / "s", 3)
    _cut(sharded / checkpoint.SIDE)
    assert checkpoint.incomplete(sharded) == f"{checkpoint.SIDE} is truncated"
    (sharded / "__0_0.distcp").unlink()
    (sharded / checkpoint.SIDE).unlink()
    assert checkpoint.incomplete(sharded) == "shard __0_0.distcp is missing"
