"""The job file's ``train:`` section: what the shared entrypoint runs on every rank.

This module must not import torch: the planner and the CLI validate and read it (the model size,
precision, optimizer and strategy feed the memory check) on machines that have no torch
installed.

Two sections say how the data-parallel work is laid out. ``strategy`` (``ddp``, ``fsdp`` or
``auto``, with ``fsdp:`` and ``activation_checkpointing``) says what each rank keeps of the
model: a whole replica, or a shard (docs/train.md, "When the model does not fit").
``global_batch_size`` with ``batch_split`` says how many samples of each step each rank takes,
so that GPUs of different speeds finish their steps together (docs/train.md, "Mixed GPUs").
:func:`combination_problems` is where the fields are checked against each other: the planner
and the entrypoint both call it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from orchestrate.core.errors import Problem
from orchestrate.core.spec.schema import Bool, Float, Int, MaybeFloat, MaybeInt, Spec, finite_values

StopSignal = Literal["SIGTERM", "SIGUSR2", "SIGINT", "SIGHUP"]


def _default_stop_signals() -> list[StopSignal]:
    return ["SIGTERM", "SIGUSR2"]


Precision = Literal["fp32", "bf16", "bf16-mixed", "fp16", "fp16-mixed", "bf16-true"]
#: What each rank keeps of the model: ``ddp`` a whole replica, ``fsdp`` a shard (FSDP2's
#: ``fully_shard``), ``auto`` the first of ddp, fsdp, fsdp + activation checkpointing whose
#: estimated peak fits every planned GPU (the planner decides and writes it into train.json).
Strategy = Literal["ddp", "fsdp", "auto"]
#: How ``global_batch_size`` is split over the ranks (``batch_shares`` lists them by hand).
BatchSplit = Literal["equal", "proportional", "measured"]


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


def _class_names(value: object) -> object:
    """``wrap: Block`` means ``[Block]``: one class name is a list of one."""
    if isinstance(value, str) and value != "auto":
        return [value]
    return value


class FsdpSpec(Spec):
    """How ``strategy: fsdp`` shards the model (FSDP2's ``fully_shard``)."""

    wrap: Literal["auto"] | list[str] = Field(
        default="auto",
        description="module classes that become one sharding unit each (their parameters are "
        "gathered together); auto: the repeated child blocks")
    reshard_after_forward: Bool = Field(
        default=True, description="free gathered parameters after forward (ZeRO-3); false keeps "
        "them until backward (ZeRO-2: more memory, one all-gather less)")
    cpu_offload: Bool = Field(
        default=False, description="keep sharded parameters, gradients and the optimizer step "
        "on the host (GPU jobs only)")
    mixed_precision: Literal["fp32", "bf16"] = Field(
        default="fp32", description="bf16: gather parameters and compute in bfloat16, reduce "
        "gradients in float32")

    @field_validator("wrap", mode="before")
    @classmethod
    def _one_name(cls, value: object) -> object:
        return _class_names(value)

    @field_validator("wrap")
    @classmethod
    def _names(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not value:
            raise ValueError("name at least one module class, or write auto")
        return value


class BatchPlan(Spec):
    """The planner's resolution of ``batch_split`` for one plan: each rank's share of the global
    batch and the largest batch each rank's memory holds. Written into train.json by the
    planner; leave it out of job files."""

    shares: list[Int] = Field(min_length=1)
    caps: list[MaybeInt] = Field(default_factory=list)


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
    global_batch_size: MaybeInt = Field(
        default=None, ge=1, description="samples per optimizer step over all ranks, split by "
        "batch_split (instead of batch_size)")
    batch_split: BatchSplit = Field(
        default="equal", description="equal, proportional (to each GPU's speed), or measured "
        "(from the first steps' timings)")
    batch_shares: list[Int] | None = Field(
        default=None, description="each rank's share of global_batch_size, instead of "
        "batch_split")
    batch_measure_steps: Int = Field(
        default=20, ge=1, description="measured: steps timed before the shares are set")
    batch_rebalance: Literal["once", "epoch"] = Field(
        default="once", description="measured: set the shares once, or again every epoch")
    batch_plan: BatchPlan | None = Field(
        default=None, description="written by the planner (the resolved shares); leave unset")
    grad_accum_steps: Int = Field(default=1, ge=1)
    grad_clip_norm: MaybeFloat = Field(default=None, gt=0)
    precision: Precision = "fp32"
    strategy: Strategy = Field(
        default="ddp", description="ddp (a replica per rank), fsdp (sharded), or auto (the "
        "planner picks from the estimated memory)")
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec)
    activation_checkpointing: Bool | list[str] = Field(
        default=False, description="recompute activations in backward: true for the blocks "
        "that fsdp.wrap names (or finds), or a list of module classes")
    memory_trace_s: Float = Field(
        default=60.0, ge=0, le=3600, description="seconds the planner may trace a step on fake "
        "tensors to estimate memory; 0: the formula only")
    seed: Int = 0
    num_workers: Int = Field(default=0, ge=0)
    checkpoint_dir: str | None = None
    checkpoint_every_steps: Int = Field(default=0, ge=0, description="0: at the end of each epoch")
    keep_checkpoints: Int = Field(default=3, ge=1)
    checkpoint_async: Bool = Field(
        default=True, description="copy the state to host memory and write it in the "
        "background while training goes on (synchronous when the copy would not fit)")
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

    @field_validator("batch_shares")
    @classmethod
    def _shares(cls, value: list[int] | None) -> list[int] | None:
        if value is not None:
            if not value:
                raise ValueError("list every rank's share, or leave it out for batch_split")
            if any(share < 1 for share in value):
                raise ValueError("every rank's share is at least 1 sample")
        return value

    @property
    def split_name(self) -> str:
        """How the global batch is split: manual (batch_shares), or batch_split's word."""
        return "manual" if self.batch_shares is not None else self.batch_split

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

    @property
    def sharded(self) -> bool:
        """Whether the ranks run FSDP (after the planner resolved ``auto``)."""
        return self.strategy == "fsdp"


def combination_problems(train: TrainSpec, source: str, prefix: str = "train.", *,
                         as_written: bool = True) -> list[Problem]:
    """Settings that are valid alone and cannot work together, each with what to do instead.

    Checked by the planner (``prefix`` "train.", the job file's fields as written) and by the
    entrypoint on the config the planner wrote (``prefix`` "", ``as_written`` False: that file
    holds every field, so which ones a person wrote cannot be told there).
    """
    problems: list[Problem] = []
    if as_written and train.global_batch_size is not None and (
            "batch_size" in train.model_fields_set):
        problems.append(Problem(
            "give batch_size (per rank) or global_batch_size (split over the ranks by "
            "batch_split), not both", source=source, field=f"{prefix}batch_size",
            got=str(train.batch_size), hint="drop batch_size"))
    if train.strategy != "ddp" and train.precision in ("fp16", "fp16-mixed"):
        problems.append(Problem(
            "fp16 needs a gradient scaler, and FSDP2 has no sharded one", source=source,
            field=f"{prefix}precision", got=train.precision,
            hint="use bf16 (or fsdp.mixed_precision: bf16), which needs no scaler, or "
            "strategy: ddp"))
    if train.strategy == "ddp" and train.fsdp.cpu_offload:
        problems.append(Problem(
            "CPU offload is a sharding feature; DDP keeps a whole replica on every GPU",
            source=source, field=f"{prefix}fsdp.cpu_offload", got="true",
            hint="set strategy: fsdp (or auto), or drop cpu_offload"))
    problems.extend(_batch_problems(train, source, prefix))
    return problems


def _batch_problems(train: TrainSpec, source: str, prefix: str) -> list[Problem]:
    """``batch_split`` and the measuring settings without a global batch to split, and a
    global batch that cannot be cut into equal micro-batches."""
    problems: list[Problem] = []
    if train.global_batch_size is None:
        for name, given in (("batch_split", train.batch_split != "equal"),
                            ("batch_shares", train.batch_shares is not None),
                            ("batch_plan", train.batch_plan is not None)):
            if given:
                problems.append(Problem(
                    "a batch split needs global_batch_size (batch_size is per rank already)",
                    source=source, field=f"{prefix}{name}", got=str(getattr(train, name)),
                    hint="set global_batch_size: the samples of one step over all ranks"))
        return problems
    if train.batch_shares is not None and train.batch_split != "equal":
        problems.append(Problem(
            "give batch_split or batch_shares (each rank's share), not both", source=source,
            field=f"{prefix}batch_split", got=train.batch_split, hint="drop one of them"))
    if train.batch_split == "measured" and train.strategy == "fsdp":
        problems.append(Problem(
            "measured shares time each rank's backward up to the last DDP gradient bucket; "
            "FSDP has no such point, so its waits would count as compute", source=source,
            field=f"{prefix}batch_split", got="measured",
            hint="under strategy: fsdp use batch_split: proportional or list batch_shares"))
    accum = train.grad_accum_steps
    if train.global_batch_size % accum:
        problems.append(Problem(
            f"must be a multiple of grad_accum_steps ({accum}): every micro-batch takes "
            "the same number of samples", source=source, field=f"{prefix}global_batch_size",
            got=str(train.global_batch_size),
            hint=f"use {train.global_batch_size // accum * accum or accum} or change "
            "grad_accum_steps"))
    return problems
