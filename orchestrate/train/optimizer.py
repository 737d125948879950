"""The optimizer and its learning-rate schedule, from the job's ``optimizer`` and ``scheduler``.

The schedule is a pure function of the optimizer step (:func:`lr_factor`), wrapped in
``LambdaLR`` and stepped once per optimizer step, so it resumes exactly from a checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from orchestrate.core.spec.trainspec import OptimizerSpec, SchedulerSpec


def build_optimizer(
    spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """AdamW or SGD over ``params``."""
    if spec.name == "adamw":
        return torch.optim.AdamW(
            params, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay
        )
    return torch.optim.SGD(
        params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay
    )


def lr_factor(spec: SchedulerSpec, step: int, total_steps: int) -> float:
    """Multiplier of the base learning rate for optimizer step ``step`` (0-based).

    Linear warmup over ``warmup_steps`` (the first step already uses 1/warmup of the rate), then
    cosine or linear decay to ``min_lr_ratio`` at ``total_steps``, or constant.
    """
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    if spec.name == "constant":
        return 1.0
    span = max(1, total_steps - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    decay = cosine if spec.name == "cosine" else 1.0 - progress
    return spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * decay


def build_scheduler(
    spec: SchedulerSpec | None, optimizer: torch.optim.Optimizer, total_steps: int
) -> LambdaLR | None:
    """The schedule over ``total_steps`` optimizer steps, or None for a fixed rate."""
    if spec is None:
        return None
    return LambdaLR(optimizer, lambda step: lr_factor(spec, step, total_steps))
