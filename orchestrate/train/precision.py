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

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast for the forward pass and loss, or nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

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
    return PrecisionPlan(device.type, autocast, param_dtype, scaler)
