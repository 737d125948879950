"""The loss: a built-in name or the user's ``module:function``.

A loss is called as ``loss(output, target)`` and returns the *mean* over the batch (what
``torch.nn.functional`` losses do by default); validation multiplies by the batch size to get
exact sums. Built-ins compute in float32 even when the model's output is bf16/fp16.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from orchestrate.train import factories

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.float(), target)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target.float())


def resolve_loss(name: str) -> LossFn:
    """The loss function named by the ``loss`` field."""
    if name == "cross_entropy":
        return _cross_entropy
    if name == "mse":
        return _mse
    return factories.resolve(name, "loss")
