"""Which samples each rank sees: disjoint training shards, exact validation shards.

Training uses :class:`~torch.utils.data.DistributedSampler` (without it every rank trains on the
same data) with ``set_epoch`` each epoch, so shards are reshuffled per epoch in an order every
rank agrees on. ``drop_last=True`` keeps the shards disjoint: the few samples (fewer than the
number of ranks) that do not divide evenly are left out, a different few each epoch, instead of
being duplicated as padding. The sampler can also start mid-epoch, which a resumed run needs.

Validation must not pad either: a padded shard counts some samples twice and the metric is no
longer the single-process one. Each rank takes a strided slice (``rank, rank + world, ...``),
evaluates all of it, and the sums are all-reduced.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import Dataset, DistributedSampler, Subset


class ResumableSampler(DistributedSampler[Any]):
    """A shuffling, disjoint :class:`DistributedSampler` that can skip the start of an epoch."""

    def __init__(self, dataset: Dataset[Any], *, num_replicas: int, rank: int, seed: int):
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.skip = 0

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())
        return iter(indices[self.skip :])

    def __len__(self) -> int:
        return max(0, self.num_samples - self.skip)


def validation_shard(dataset: Dataset[Any], rank: int, world_size: int) -> Subset[Any]:
    """This rank's disjoint, unpadded slice of the validation set."""
    size = len(dataset) if isinstance(dataset, Sized) else 0
    return Subset(dataset, range(rank, size, world_size))
