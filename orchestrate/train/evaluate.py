"""Validation with exact metrics: the same numbers a single process would compute.

Each rank evaluates its unpadded shard (:func:`~orchestrate.train.sampling.validation_shard`),
sums loss x batch size, correct predictions and sample counts, and the sums are all-reduced.
Evaluation calls the unwrapped module, not DDP: DDP's forward may broadcast buffers, a collective
that would hang when shards have different numbers of batches. An FSDP module cannot be
unwrapped (each unit gathers its parameters in its forward, a collective), so under FSDP the
ranks agree on the most batches any of them has and the others run as many forwards on a borrowed
sample whose results are not counted (``lockstep``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from orchestrate.train.losses import LossFn, batch_loss, parts
from orchestrate.train.precision import PrecisionPlan


@dataclass(frozen=True)
class Evaluation:
    """Validation results over the whole validation set."""

    loss: float
    accuracy: float | None  # None unless outputs are class scores and targets class indices
    samples: int


def _is_classification(output: torch.Tensor, target: torch.Tensor) -> bool:
    return output.ndim == 2 and target.ndim == 1 and not target.is_floating_point()


def _lockstep(batches: Iterable[Any], dataset: Any,
              control: dist.ProcessGroup | None) -> Iterator[Any]:
    """This rank's batches, then as many borrowed ones (``(None, batch)``: not counted) as
    it takes to reach the most batches any rank has."""
    count = len(batches)  # type: ignore[arg-type]
    counts: list[Any] = [count]
    if control is not None:
        counts = [None] * dist.get_world_size(control)
        dist.all_gather_object(counts, count, group=control)
    first = None
    for batch in batches:
        first = batch if first is None else first
        yield batch
    filler = first if first is not None else default_collate([dataset[0]])
    for _ in range(max(counts) - count):
        yield (None, filler)


def evaluate(
    module: torch.nn.Module,
    batches: Iterable[Any],
    loss_fn: LossFn,
    precision: PrecisionPlan,
    device: torch.device,
    *,
    distributed: bool,
    lockstep: Any = None,
    control: dist.ProcessGroup | None = None,
) -> Evaluation:
    """Evaluate ``module`` on this rank's ``batches``; all ranks must call it together.
    ``lockstep`` (the whole validation set) makes every rank run the same number of forwards
    (FSDP)."""
    was_training = module.training
    module.eval()
    if lockstep is not None:
        batches = _lockstep(batches, lockstep, control)
    # loss sum, correct, samples, samples with class outputs, weight
    totals = torch.zeros(5, dtype=torch.float64, device=device)
    try:
        with torch.no_grad():
            for batch in batches:
                if batch[0] is None:  # borrowed: a forward only, for the units' collectives
                    with precision.autocast():
                        module(precision.cast_input(batch[1][0].to(device, non_blocking=True)))
                    continue
                inputs, target, weight = parts(batch)
                inputs = precision.cast_input(inputs.to(device, non_blocking=True))
                target = target.to(device, non_blocking=True)
                if weight is not None:
                    weight = weight.to(device, non_blocking=True)
                with precision.autocast():
                    output = module(inputs)
                    loss = batch_loss(loss_fn, output, target, weight)
                count = len(target)
                # With weights the loss is the mean over the batch's weight: sum by weight.
                totals[0] += loss.detach().double() * (
                    count if weight is None else weight.double().sum())
                totals[2] += count
                totals[4] += count if weight is None else weight.double().sum()
                if _is_classification(output, target):
                    totals[1] += (output.argmax(dim=1) == target).sum()
                    totals[3] += count
    finally:
        module.train(was_training)
    if distributed:
        dist.all_reduce(totals)
    loss_sum, correct, samples, classified, weights = totals.tolist()
    accuracy = correct / samples if samples and classified == samples else None
    return Evaluation(loss=loss_sum / weights if weights else float("nan"), accuracy=accuracy,
                      samples=int(samples))
