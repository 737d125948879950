"""The loss: a built-in name or the user's ``module:function``.

A loss is called as ``loss(output, target)`` and returns the *mean* over the batch (what
``torch.nn.functional`` losses do by default); validation multiplies by the batch size to get
exact sums. Built-ins compute in float32 even when the model's output is bf16/fp16.

Per-sample weights: a dataset whose items are ``(input, target, weight)`` (``weight`` a number
per sample, e.g. its count of target tokens) makes every step's gradient the weighted mean over
the whole global batch: each micro-batch's loss must then be the mean over its weight (a
built-in computes each sample's mean loss and averages them by weight, which for token counts is
the mean over the micro-batch's tokens; ``F.cross_entropy`` with ``ignore_index`` already is),
and the trainer scales it by its share of the step's total weight (one all-reduce per step;
see :mod:`orchestrate.train.trainer`). A user's loss that takes a third argument gets the
weights; one that takes two is trusted to return that mean already.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

from orchestrate.train import factories

LossFn = Callable[..., torch.Tensor]
IGNORE_INDEX = -100  # F.cross_entropy's: target positions that are no token


def _weighted(per_position: torch.Tensor, valid: torch.Tensor, weight: torch.Tensor
              ) -> torch.Tensor:
    """Each sample's mean over its valid positions, averaged by ``weight``."""
    if per_position.ndim > 1:
        per_sample = (per_position.flatten(1).sum(1)
                      / valid.flatten(1).sum(1).clamp(min=1).to(per_position))
    else:
        per_sample = per_position
    w = weight.to(per_sample)
    return (per_sample * w).sum() / w.sum().clamp(min=torch.finfo(w.dtype).tiny)


def _cross_entropy(output: torch.Tensor, target: torch.Tensor,
                   weight: torch.Tensor | None = None) -> torch.Tensor:
    if weight is None:
        return F.cross_entropy(output.float(), target)
    per = F.cross_entropy(output.float(), target, reduction="none")
    return _weighted(per, target != IGNORE_INDEX, weight)


def _mse(output: torch.Tensor, target: torch.Tensor,
         weight: torch.Tensor | None = None) -> torch.Tensor:
    if weight is None:
        return F.mse_loss(output.float(), target.float())
    per = F.mse_loss(output.float(), target.float(), reduction="none")
    return _weighted(per, torch.ones_like(per), weight)


def resolve_loss(name: str) -> LossFn:
    """The loss function named by the ``loss`` field."""
    if name == "cross_entropy":
        return _cross_entropy
    if name == "mse":
        return _mse
    return factories.resolve(name, "loss")


@lru_cache(maxsize=32)
def takes_weight(fn: LossFn) -> bool:
    """Whether ``fn`` accepts a third positional argument (the per-sample weights)."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in positional)


def batch_loss(fn: LossFn, output: torch.Tensor, target: torch.Tensor,
               weight: torch.Tensor | None) -> torch.Tensor:
    """``fn`` on one batch, with its weights when there are any and ``fn`` takes them."""
    if weight is not None and takes_weight(fn):
        return fn(output, target, weight)
    return fn(output, target)


def parts(batch: Any) -> tuple[Any, Any, torch.Tensor | None]:
    """A batch's inputs, targets and per-sample weights (None without a third element)."""
    items = tuple(batch)
    return items[0], items[1], (items[2] if len(items) > 2 else None)
