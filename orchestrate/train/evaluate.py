"""Validation with exact metrics: the same numbers a single process would compute.

Each rank evaluates its unpadded shard (:func:`~orchestrate.train.sampling.validation_shard`),
sums loss x batch size, correct predictions and sample counts, and the sums are all-reduced.
Evaluation calls the unwrapped module, not DDP: DDP's forward may broadcast buffers, a collective
that would hang when shards have different numbers of batches.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from orchestrate.train.losses import LossFn
from orchestrate.train.precision import PrecisionPlan


@dataclass(frozen=True)
class Evaluation:
    """Validation results over the whole validation set."""

    loss: float
    accuracy: float | None  # None unless outputs are class scores and targets class indices
    samples: int


def _is_classification(output: torch.Tensor, target: torch.Tensor) -> bool:
    return output.ndim == 2 and target.ndim == 1 and not target.is_floating_point()


def evaluate(
    module: torch.nn.Module,
    batches: Iterable[Any],
    loss_fn: LossFn,
    precision: PrecisionPlan,
    device: torch.device,
    *,
    distributed: bool,
) -> Evaluation:
    """Evaluate ``module`` on this rank's ``batches``; all ranks must call it together."""
    was_training = module.training
    module.eval()
    # loss sum, correct, samples, samples with class outputs
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    try:
        with torch.no_grad():
            for inputs, target in batches:
                inputs = precision.cast_input(inputs.to(device, non_blocking=True))
                target = target.to(device, non_blocking=True)
                with precision.autocast():
                    output = module(inputs)
                    loss = loss_fn(output, target)
                count = len(target)
                totals[0] += loss.detach().double() * count
                totals[2] += count
                if _is_classification(output, target):
                    totals[1] += (output.argmax(dim=1) == target).sum()
                    totals[3] += count
    finally:
        module.train(was_training)
    if distributed:
        dist.all_reduce(totals)
    loss_sum, correct, samples, classified = totals.tolist()
    accuracy = correct / samples if samples and classified == samples else None
    return Evaluation(loss=loss_sum / samples if samples else float("nan"), accuracy=accuracy,
                      samples=int(samples))
