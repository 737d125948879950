"""The shared batch sampler's promise, in one process: whatever the split, the ranks' slices of
each step put together are the same global batch, every rank has the same number of steps, and
the loss scale makes the averaged gradient the global batch's."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrate.core.spec.trainspec import TrainSpec
from orchestrate.train.batchshares import RankBatch, SharedBatchSampler, for_rank, shares_of
from orchestrate.train.failure import TrainFailure

pytestmark = [pytest.mark.unit, pytest.mark.torch]


def _spec(**kw: Any) -> TrainSpec:
    return TrainSpec.model_validate({"model": "m:f", "dataset": "d:f", **kw})


def _global_batches(shares: list[int], size: int, epoch: int) -> list[list[int]]:
    per_rank = []
    for rank in range(len(shares)):
        sampler = SharedBatchSampler(list(range(size)), RankBatch(tuple(shares), rank), seed=9)  # type: ignore[arg-type]
        sampler.set_epoch(epoch)
        got = list(sampler)
        b = shares[rank]
        per_rank.append([got[i:i + b] for i in range(0, len(got), b)])
    assert len({len(steps) for steps in per_rank}) == 1, "every rank runs the same steps"
    return [[i for steps in per_rank for i in steps[s]] for s in range(len(per_rank[0]))]


def test_every_split_draws_the_same_global_batches() -> None:
    one = _global_batches([64], 1437, epoch=2)
    assert len(one) == 1437 // 64
    assert _global_batches([48, 16], 1437, epoch=2) == one
    assert _global_batches([32, 32], 1437, epoch=2) == one
    assert _global_batches([30, 20, 14], 1437, epoch=2) == one
    assert _global_batches([64], 1437, epoch=3) != one, "reshuffled each epoch"


def test_skip_resumes_mid_epoch_at_the_same_samples() -> None:
    sampler = SharedBatchSampler(list(range(500)), RankBatch((48, 16), 1), seed=9)  # type: ignore[arg-type]
    whole = list(sampler)
    sampler.skip = 3 * 16
    assert list(sampler) == whole[48:] and len(sampler) == len(whole) - 48


def test_loss_scale_and_the_rank_spec() -> None:
    spec, mine = for_rank(_spec(global_batch_size=64, batch_shares=[48, 16]), 1, 2)
    assert mine is not None and spec.batch_size == 16 and mine.loss_scale == 16 * 2 / 64
    assert shares_of(_spec(global_batch_size=64), 3) == [22, 21, 21]
    assert for_rank(_spec(batch_size=8), 0, 2) == (_spec(batch_size=8), None)


@pytest.mark.parametrize("kw, world", [
    ({"global_batch_size": 64, "batch_shares": [40, 16]}, 2),
    ({"global_batch_size": 64, "batch_shares": [48, 8, 8]}, 2),
    ({"global_batch_size": 2}, 3),
])
def test_shares_that_cannot_split_are_refused(kw: dict[str, Any], world: int) -> None:
    with pytest.raises(TrainFailure, match="global_batch_size"):
        shares_of(_spec(**kw), world)
