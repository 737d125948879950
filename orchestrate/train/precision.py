"""Numeric precision of the training step, from the ``precision`` field.

- ``fp32``: everything in float32.
- ``bf16`` / ``bf16-mixed``: float32 parameters, forward under ``torch.autocast(bfloat16)``.
- ``fp16`` / ``fp16-mixed``: float32 parameters, autocast float16 and a ``GradScaler`` so small
  gradients do not underflow. A GPU recipe: refused on CPUs.
- ``bf16-true``: parameters, gradients and optimizer state all in bfloat16 (half the memory of
  the mixed modes; the planner's estimate follows ``TrainSpec.param_dtype``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from orchestrate.core.errors import Problem, UserError
from orchestrate.core.spec.trainspec import TrainSpec


@dataclass(frozen=True)
class PrecisionPlan:
    """What the step does about dtypes."""

    device_type: str
    autocast_dtype: torch.dtype | None
    param_dtype: torch.dtype
    scaler: torch.amp.GradScaler | None
    #: Whether autocast keeps its low-precision copy of each weight for the whole forward pass
    #: (off under activation checkpointing, see :func:`plan_precision`)
    cache: bool = True

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast for the forward pass and loss, or nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype,
                              cache_enabled=self.cache)

    def cast_input(self, value: torch.Tensor) -> torch.Tensor:
        """Floating inputs in the parameters' dtype (needed by ``bf16-true``)."""
        if value.is_floating_point() and value.dtype != self.param_dtype:
            return value.to(self.param_dtype)
        return value


def _refuse(message: str, hint: str, got: str) -> UserError:
    return UserError(Problem(message, source="train", field="precision", got=got, hint=hint))


def plan_precision(spec: TrainSpec, device: torch.device) -> PrecisionPlan:
    """The precision plan for ``spec`` on ``device``; refuses what the device cannot do."""
    autocast = getattr(torch, spec.autocast_dtype) if spec.autocast_dtype else None
    param_dtype = getattr(torch, spec.param_dtype)
    cuda = device.type == "cuda"
    if autocast is torch.float16 and not cuda:
        raise _refuse(
            "fp16 mixed precision needs CUDA GPUs (fp16 autocast with a gradient scaler is a "
            "GPU recipe)",
            "use bf16 or fp32 on CPUs",
            spec.precision,
        )
    wants_bf16 = autocast is torch.bfloat16 or param_dtype is torch.bfloat16
    if wants_bf16 and cuda and not torch.cuda.is_bf16_supported():
        raise _refuse(
            f"{torch.cuda.get_device_name(device)} has no bfloat16 support",
            "use fp16 (mixed) or fp32 on this GPU",
            spec.precision,
        )
    scaler = torch.amp.GradScaler("cuda") if autocast is torch.float16 else None
    # autocast caches the bf16 copy of every weight until the forward pass ends: under FSDP,
    # whose gathered weights are freed after each unit, the whole model's copies. Without
    # checkpointing autograd keeps them for backward anyway; with it, only the cache would, so
    # it is off and each copy is made again when the block is recomputed (the same values;
    # traced on a LLaMA-7B shape: 13.5 GB less at the end of forward, docs/train.md).
    cache = spec.activation_checkpointing is False
    return PrecisionPlan(device.type, autocast, param_dtype, scaler, cache)
