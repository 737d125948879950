"""Unequal per-rank batches with exact gradients: ``global_batch_size`` split into shares.

Each step's global batch of B samples is the next B of one seeded permutation of the training
set (the same on every rank: ``seed`` + epoch, as ``DistributedSampler`` draws it), and rank r
takes the slice of its share b_r (ranks in order). DDP and FSDP average the ranks' gradients,
so rank r's mean loss is scaled by ``b_r * W / B``: the average of the scaled gradients is then
the gradient of the mean loss over the whole global batch, whatever the split (checked to 1e-5
against one process on the same batches in tests/train/test_train_shares.py). Every split
therefore trains on the same sequence of global batches, and every rank runs the same number of
micro-steps, ``len(train set) // B`` an epoch (B per micro-step: ``global_batch_size`` over
``grad_accum_steps``; the rest, fewer than B samples, is left out, a
different rest each epoch). ``DistributedSampler`` cannot do this: it pads ranks to equal
shards.

The shares come from the planner (``batch_plan.shares`` in the train.json it writes: equal,
proportional to each GPU's speed, or listed in ``batch_shares``), or, for a config written by
hand, from ``batch_shares`` or an equal split.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from orchestrate.core.plan.shares import apportion
from orchestrate.core.spec.trainspec import TrainSpec
from orchestrate.train.failure import TrainFailure


def shares_of(spec: TrainSpec, world: int) -> list[int] | None:
    """Every rank's share of the global batch, or None for a plain per-rank ``batch_size``."""
    if spec.global_batch_size is None:
        return None
    total = spec.global_batch_size // spec.grad_accum_steps  # the samples of one micro-step
    if spec.batch_plan is not None:
        shares = list(spec.batch_plan.shares)
    elif spec.batch_shares is not None:
        shares = list(spec.batch_shares)
    else:
        if total < world:
            raise TrainFailure(f"global_batch_size {total} is smaller than the {world} ranks")
        shares = apportion(total, [1.0] * world, [None] * world)
    if len(shares) != world or sum(shares) != total or min(shares) < 1:
        raise TrainFailure(
            f"batch shares {shares} do not split global_batch_size {spec.global_batch_size} "
            f"over {world} ranks (one share of at least 1 per rank, summing to {total}: the "
            "global batch over grad_accum_steps)")
    return shares


@dataclass(frozen=True)
class RankBatch:
    """This rank's part of each global batch."""

    shares: tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return self.shares[self.rank]

    @property
    def total(self) -> int:
        return sum(self.shares)

    @property
    def offset(self) -> int:
        return sum(self.shares[: self.rank])

    @property
    def loss_scale(self) -> float:
        """``b_r * W / B``: what makes the ranks' averaged gradients the global batch's."""
        return self.size * len(self.shares) / self.total


def for_rank(spec: TrainSpec, rank: int, world: int) -> tuple[TrainSpec, RankBatch | None]:
    """The spec this rank trains with (``batch_size`` its share) and its share, or ``spec`` as
    it is and None when the job gives a per-rank ``batch_size``."""
    shares = shares_of(spec, world)
    if shares is None:
        return spec, None
    mine = RankBatch(tuple(shares), rank)
    return spec.model_copy(update={"batch_size": mine.size}), mine


class SharedBatchSampler(Sampler[list[int]]):
    """This rank's batches: its slice of each global batch in turn (see the module docstring).

    A *batch* sampler (``DataLoader(batch_sampler=...)``), so that :meth:`reshare` can change
    the share between two steps (``batch_split: measured``): the next iteration cuts the same
    global batches with the new shares. ``skip`` counts the batches (global steps of the
    epoch) already done, which does not depend on the shares; like
    :class:`~orchestrate.train.sampling.ResumableSampler` it has ``set_epoch`` and
    ``num_samples`` (this rank's samples per epoch under the current share).
    """

    def __init__(self, dataset: Dataset[Any], batch: RankBatch, *, seed: int) -> None:
        self.size = len(dataset) if isinstance(dataset, Sized) else 0
        self.batch = batch
        self.seed = seed
        self.epoch = 0
        self.skip = 0
        self.steps = self.size // batch.total

    @property
    def num_samples(self) -> int:
        return self.steps * self.batch.size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def reshare(self, shares: tuple[int, ...]) -> None:
        """Cut the next iteration's batches with ``shares`` (same total)."""
        if sum(shares) != self.batch.total:
            raise ValueError(f"shares {list(shares)} do not add up to {self.batch.total}")
        self.batch = RankBatch(shares, self.batch.rank)

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=generator).tolist()
        batch = self.batch
        for step in range(self.skip, self.steps):
            start = step * batch.total + batch.offset
            yield order[start : start + batch.size]

    def __len__(self) -> int:
        return max(0, self.steps - self.skip)
