"""The job file's ``train:`` section: what the shared DDP entrypoint runs on every rank.

This module must not import torch: the planner and the CLI validate and read it (the model size,
precision and optimizer feed the memory check) on machines that have no torch installed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from orchestrate.core.spec.schema import Bool, Float, Int, MaybeFloat, MaybeInt, Spec, finite_values

StopSignal = Literal["SIGTERM", "SIGUSR2", "SIGINT", "SIGHUP"]


def _default_stop_signals() -> list[StopSignal]:
    return ["SIGTERM", "SIGUSR2"]


Precision = Literal["fp32", "bf16", "bf16-mixed", "fp16", "fp16-mixed", "bf16-true"]


def _check_import_path(value: str) -> str:
    module, sep, attr = value.partition(":")
    if not sep or not module or not attr:
        raise ValueError("must be 'package.module:function'")
    return value


class OptimizerSpec(Spec):
    """The optimizer: AdamW or SGD, the two that cover nearly every DDP recipe."""

    name: Literal["adamw", "sgd"] = "adamw"
    lr: Float = Field(default=1e-3, gt=0)
    weight_decay: Float = Field(default=0.0, ge=0)
    momentum: Float = Field(default=0.9, ge=0, description="SGD only")
    betas: tuple[Float, Float] = (0.9, 0.999)


class SchedulerSpec(Spec):
    """Learning-rate schedule over the whole run, stepped once per optimizer step."""

    name: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: Int = Field(default=0, ge=0)
    min_lr_ratio: Float = Field(default=0.0, ge=0, le=1)


class TrainSpec(Spec):
    """Settings of ``python -m orchestrate.train``; see docs/train.md for each one's effect."""

    model: str = Field(description="factory 'module:function' returning a torch.nn.Module")
    model_args: dict[str, Any] = Field(default_factory=dict)
    dataset: str = Field(
        description="factory 'module:function' returning (train_dataset, val_dataset or None)"
    )
    dataset_args: dict[str, Any] = Field(default_factory=dict)
    loss: str = "cross_entropy"
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    scheduler: SchedulerSpec | None = None
    epochs: Int = Field(default=1, ge=1)
    max_steps: MaybeInt = Field(default=None, ge=1, description="stop after this many steps")
    batch_size: Int = Field(default=32, ge=1, description="per rank")
    grad_accum_steps: Int = Field(default=1, ge=1)
    grad_clip_norm: MaybeFloat = Field(default=None, gt=0)
    precision: Precision = "fp32"
    seed: Int = 0
    num_workers: Int = Field(default=0, ge=0)
    checkpoint_dir: str | None = None
    checkpoint_every_steps: Int = Field(default=0, ge=0, description="0: at the end of each epoch")
    keep_checkpoints: Int = Field(default=3, ge=1)
    init_from: str | None = None
    gradient_as_bucket_view: Bool = True
    find_unused_parameters: Bool = False
    bucket_cap_mb: Float = Field(default=25.0, gt=0)
    # Bounded so that the memory estimate (bytes: params x 16) stays a finite number.
    model_params: MaybeFloat = Field(
        default=None, gt=0, le=1e15, description="parameter count for the planner's memory check"
    )
    activation_memory_gb: Float = Field(
        default=2.0,
        ge=0,
        le=1e6,
        description="allowance per GPU for activations, CUDA context and allocator slack",
    )
    log_every_steps: Int = Field(default=0, ge=0, description="0: one metrics line per epoch")
    stop_signals: list[StopSignal] = Field(default_factory=_default_stop_signals)
    tensorboard: Bool = False
    wandb: Bool = False

    @field_validator("model", "dataset")
    @classmethod
    def _factory(cls, value: str) -> str:
        return _check_import_path(value)

    @field_validator("model_args", "dataset_args")
    @classmethod
    def _finite(cls, value: dict[str, Any]) -> dict[str, Any]:
        return dict(finite_values(value))

    @field_validator("loss")
    @classmethod
    def _loss(cls, value: str) -> str:
        if value in ("cross_entropy", "mse"):
            return value
        return _check_import_path(value)

    @property
    def autocast_dtype(self) -> str | None:
        """The autocast dtype name, or None when the step runs in the parameters' dtype."""
        if self.precision in ("bf16", "bf16-mixed"):
            return "bfloat16"
        if self.precision in ("fp16", "fp16-mixed"):
            return "float16"
        return None

    @property
    def param_dtype(self) -> str:
        """The dtype parameters, gradients and optimizer state are held in."""
        return "bfloat16" if self.precision == "bf16-true" else "float32"
