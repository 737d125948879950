"""What would fit instead: the refusal's hint, made of layouts the planner itself found to fit.

When no layout the job allows fits, a list of generic remedies ("try bf16-true") sends people to
settings that may not fit either, or whose estimate the planner never made (issue #34: the hint
named ``bf16-true``, whose trace failed, and missed ``fsdp: {mixed_precision: bf16}``, which the
planner's own numbers showed fitting). So the planner tries each change below on the placed
ranks, with the same estimate it plans with, and the hint names only those that fit, each with
its layout and its numbers. A change of precision cannot reuse the job's traced peaks (they were
traced at the job's precision), so its numbers are the formula's, and the hint says so.

Pure: values in, values out; :mod:`orchestrate.core.plan.strategy` runs the tries.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from orchestrate.core.plan.memory import ModelFacts

if TYPE_CHECKING:  # annotations only: planning values need no pydantic import
    from orchestrate.core.spec.trainspec import TrainSpec


@dataclass(frozen=True)
class Change:
    """One change to the job's ``train:`` section, as a person would write it."""

    text: str  # e.g. "precision: fp32, fsdp: {mixed_precision: bf16}"
    train: TrainSpec
    same_precision: bool  # the job's traced peaks still apply


def changes(train: TrainSpec, gpu: bool) -> list[Change]:
    """The changes worth trying for ``train``, each under ``strategy: auto`` (DDP, FSDP, FSDP
    with activation checkpointing): sharding at the job's precision, FSDP's own mixed precision
    (fp32 master weights, bf16 compute: no autocast copy of every weight), bf16 weights, and on
    GPUs the optimizer step on the host."""
    out: list[Change] = []
    auto = {"strategy": "auto"}
    if train.strategy != "auto":
        out.append(Change("strategy: auto", train.model_copy(update=auto), True))
    if train.fsdp.mixed_precision != "bf16" and train.precision in ("fp32", "bf16", "bf16-mixed"):
        fsdp = train.fsdp.model_copy(update={"mixed_precision": "bf16"})
        prefix = "" if train.precision == "fp32" else "precision: fp32, "
        out.append(Change(f"strategy: auto, {prefix}fsdp: {{mixed_precision: bf16}}",
                          train.model_copy(update={**auto, "precision": "fp32", "fsdp": fsdp}),
                          False))
    if train.precision != "bf16-true":
        out.append(Change("strategy: auto, precision: bf16-true (bf16 weights and AdamW state)",
                          train.model_copy(update={**auto, "precision": "bf16-true"}), False))
    if gpu and not train.fsdp.cpu_offload:
        fsdp = train.fsdp.model_copy(update={"cpu_offload": True})
        out.append(Change("strategy: fsdp, fsdp: {cpu_offload: true} (the optimizer step on "
                          "the host)", train.model_copy(update={"strategy": "fsdp",
                                                                "fsdp": fsdp}), True))
    return out


def facts_for(change: Change, facts: ModelFacts) -> ModelFacts:
    """The model's facts for ``change``: without the traced peaks when its precision differs."""
    return facts if change.same_precision else replace(facts, traced=())


@dataclass(frozen=True)
class Found:
    """A change that fits: its layout and its worst rank's peak against that rank's capacity."""

    change: Change
    layout: str
    peak: float
    capacity: float
    kind: str
    method: str


def hint(found: list[Found], generic: str) -> str:
    """The refusal's hint: the changes that fit with their numbers, then ``generic`` (more or
    bigger GPUs, a smaller batch)."""
    from orchestrate.core.plan.memory import GB, capacity_text

    if not found:
        return ("no other layout the planner knows fits either (sharding, FSDP's mixed "
                f"precision, bf16 weights, CPU offload); try {generic}")
    fits = "; ".join(
        f"`{f.change.text}` -> {f.layout}: {f.peak / GB:.1f} GB of "
        f"{capacity_text(f.capacity)} on {f.kind} ({_method(f.method)})" for f in found)
    return f"these fit by the planner's own estimate: {fits}; or {generic}"


def _method(method: str) -> str:
    return "formula, a lower bound" if method == "formula" else method


__all__ = ["Change", "Found", "changes", "facts_for", "hint"]
