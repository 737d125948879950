"""Will the model fit? DDP keeps a whole replica on every GPU, so the smallest GPU decides.

Per GPU, plain DDP holds the weights, their gradients, DDP's gradient buckets (a second copy of
the gradients unless ``gradient_as_bucket_view``), the optimizer state, and activations. The
estimate counts the first four exactly from the parameter count and adds a stated allowance for
the fifth, which depends on batch size and architecture and is the user's to tune
(``train.activation_memory_gb``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: planning values need no pydantic import (the
    # supervisor and `status` read a stored plan; docs/performance.md)
    from orchestrate.core.spec.trainspec import TrainSpec


GB = 1e9  # decimal gigabytes, as GPU vendors count them


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, by what holds them."""

    params: float
    weights: float
    gradients: float
    buckets: float
    optimizer: float
    activations: float
    optimizer_name: str
    precision: str

    @property
    def before_activations(self) -> float:
        """Everything but the activation allowance."""
        return self.weights + self.gradients + self.buckets + self.optimizer

    @property
    def total(self) -> float:
        """The per-GPU need, allowance included."""
        return self.before_activations + self.activations

    def describe(self) -> str:
        """One sentence with the numbers, e.g. for a refusal."""
        opt = {"adamw": "AdamW", "sgd": "SGD"}.get(self.optimizer_name, self.optimizer_name)
        return (
            f"{_count(self.params)} parameters with {opt} in {self.precision} need "
            f"~{self.before_activations / GB:.0f} GB per GPU before activations "
            f"(weights {self.weights / GB:.1f}, gradients {self.gradients / GB:.1f}, "
            f"DDP buckets {self.buckets / GB:.1f}, optimizer {self.optimizer / GB:.1f}) "
            f"+ {self.activations / GB:.1f} GB allowed for activations"
        )


def _count(params: float) -> str:
    """``6.7e9`` (as people write model sizes), not Python's ``6.7e+09``."""
    text = f"{params:.3g}"
    mantissa, sep, exponent = text.partition("e")
    return f"{mantissa}e{int(exponent)}" if sep else text


def estimate(train: TrainSpec, params: float) -> MemoryEstimate:
    """Per-GPU memory of DDP training ``params`` parameters with ``train``'s settings."""
    width = 2 if train.param_dtype == "bfloat16" else 4
    weights = params * width
    gradients = params * width
    buckets = 0.0 if train.gradient_as_bucket_view else params * width
    if train.optimizer.name == "adamw":
        optimizer = 2 * params * width  # exp_avg and exp_avg_sq
    elif train.optimizer.momentum > 0:
        optimizer = params * width  # momentum buffer
    else:
        optimizer = 0.0
    return MemoryEstimate(
        params=params,
        weights=weights,
        gradients=gradients,
        buckets=buckets,
        optimizer=optimizer,
        activations=train.activation_memory_gb * GB,
        optimizer_name=train.optimizer.name,
        precision=train.precision,
    )


def remedies(train: TrainSpec) -> str:
    """What a person can do when the model does not fit."""
    options = ["a GPU model with more memory (resources.gpu_model)"]
    if not train.gradient_as_bucket_view:
        options.append("train.gradient_as_bucket_view: true (drops a gradient-sized copy)")
    if train.param_dtype != "bfloat16":
        options.append("train.precision: bf16-true (halves weights, gradients, optimizer)")
    if train.optimizer.name == "adamw":
        options.append("optimizer sgd (AdamW keeps two states per parameter)")
    options.append("sharded training (FSDP/ZeRO), which DDP is not")
    return "; ".join(options)
