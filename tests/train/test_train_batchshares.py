"""The shared batch sampler's promise, in one process: whatever the split, the ranks' slices of
each step put together are the same global batch, every rank has the same number of steps, and
the loss scale makes the averaged gradient the global batch's."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrate.core.plan.shares import NoSplit
from orchestrate.core.spec.trainspec import TrainSpec
from orchestrate.train.batchshares import RankBatch, SharedBatchSampler, for_rank, shares_of
from orchestrate.train.failure import TrainFailure
from orchestrate.train.rebalance import RankCost, balanced_shares, predicted_step_s

pytestmark = [pytest.mark.unit, pytest.mark.torch]


def _spec(**kw: Any) -> TrainSpec:
    return TrainSpec.model_validate({"model": "m:f", "dataset": "d:f", **kw})


def _sampler(shares: list[int], rank: int, size: int) -> SharedBatchSampler:
    return SharedBatchSampler(list(range(size)), RankBatch(tuple(shares), rank), seed=9)  # type: ignore[arg-type]


def _global_batches(shares: list[int], size: int, epoch: int) -> list[list[int]]:
    per_rank = []
    for rank in range(len(shares)):
        sampler = _sampler(shares, rank, size)
        sampler.set_epoch(epoch)
        steps = list(sampler)
        assert all(len(batch) == shares[rank] for batch in steps)
        per_rank.append(steps)
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
    sampler = _sampler([48, 16], 1, 500)
    whole = list(sampler)
    sampler.skip = 3  # batches (global steps) done
    assert list(sampler) == whole[3:] and len(sampler) == len(whole) - 3


def test_new_shares_mid_epoch_keep_the_global_batches() -> None:
    """What ``batch_split: measured`` does: after 5 steps at [32, 32] the ranks go on at
    [44, 20]; the epoch's global batches are those of an unsplit run."""
    one = _global_batches([64], 1437, epoch=1)
    ranks = [_sampler([32, 32], rank, 1437) for rank in (0, 1)]
    steps: list[list[int]] = []
    for sampler in ranks:
        sampler.set_epoch(1)
    for batches in zip(*(list(s)[:5] for s in ranks), strict=True):
        steps.append([i for batch in batches for i in batch])
    for sampler in ranks:
        sampler.reshare((44, 20))
        sampler.skip = 5
        assert sampler.num_samples == sampler.steps * sampler.batch.size
    for batches in zip(*(list(s) for s in ranks), strict=True):
        assert [len(b) for b in batches] == [44, 20]
        steps.append([i for batch in batches for i in batch])
    assert steps == one
    with pytest.raises(ValueError, match="add up"):
        ranks[0].reshare((40, 20))


def test_balanced_shares_equalise_the_predicted_step_times() -> None:
    twice = [RankCost(per_sample_s=1e-3, fixed_s=0.0), RankCost(per_sample_s=2e-3, fixed_s=0.0)]
    assert balanced_shares(1024, twice, [None, None]) == [683, 341]
    # A fixed cost per step (the optimizer) takes time the slow rank cannot spend on samples.
    fixed = [RankCost(1e-3, 0.0), RankCost(1e-3, 0.1)]
    shares = balanced_shares(1000, fixed, [None, None])
    assert shares == [550, 450]
    assert abs(predicted_step_s(fixed, shares, 1) - 0.55) < 1e-9
    # A memory cap holds; what the capped rank cannot take goes to the other one.
    assert balanced_shares(1024, twice, [600, None]) == [600, 424]
    # Micro-steps multiply the per-sample cost, not the optimizer's.
    assert balanced_shares(100, fixed, [None, None], micro_steps=2) == [75, 25]
    with pytest.raises(NoSplit):
        balanced_shares(1024, twice, [500, 500])


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
