"""Will the model fit? One rank's memory under each strategy, from a traced step or the formula.

A rank holds its share of the model states (weights, gradients, optimizer state), a working set
that the strategy adds (DDP's gradient buckets; FSDP's gathered parameters and unsharded
gradients of the units in flight), the activations of its batch, and on a GPU the CUDA context
and NCCL's buffers. Two ways to count:

- **traced** (:class:`TracedPeak`): the job's own model ran two training steps on fake tensors
  under torch's memory trackers (``orchestrate.train.modelprobe``, called by ``load``), for this
  strategy, a world size and a per-rank batch. The peak's parts are kept by what holds them, so
  the estimate follows another world size (FSDP's shards scale as 1/world) or another batch
  (activations scale with the samples) without tracing again.
- **formula**: the states counted exactly from the parameter count (bytes per parameter by
  precision, optimizer and strategy), plus FSDP's working set from the largest sharding unit,
  autocast's copies of the weights, plus the user's allowance for activations
  (``train.activation_memory_gb``, which also covers the CUDA context), so nothing here needs
  torch. The allowance knows nothing of the model's width, sequence length or batch (a
  LLaMA-7B shape at 2,048 tokens traces 22.5 GB of activations, against 2 GB allowed), so a
  formula's plan is a lower bound, and says so.

Pure: values in, values out. The per-rank decision (which strategy, which batch shares) is
:mod:`orchestrate.core.plan.strategy`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: planning values need no pydantic import (the
    # supervisor and `status` read a stored plan; docs/performance.md)
    from orchestrate.core.spec.trainspec import TrainSpec


#: The unit every number the plan shows is in: decimal gigabytes (10^9 bytes), so that "16 bytes
#: per parameter x 6.7e9 = 107.2 GB" reads straight off the arithmetic, and the trainer's measured
#: peaks (``peak_memory_gb``) compare with the plan's.
GB = 1e9
#: What the inventory's ``memory_gb`` and ``host_memory_gb`` count: GiB, nvidia-smi's MiB / 1024
#: (an RTX A6000's 49,140 MiB is ``memory_gb: 48``, 51.5 GB), /proc/meminfo's KiB / 2^20.
GIB = float(2**30)


def capacity_bytes(memory_gb: float) -> float:
    """Bytes of an inventory's ``memory_gb`` (GiB): 48 -> 51.5e9, 80 -> 85.9e9."""
    return memory_gb * GIB


def capacity_text(capacity: float) -> str:
    """A capacity as the plan shows it: ``51.5 GB (48 GiB)``."""
    return f"{capacity / GB:.1f} GB ({capacity / GIB:.3g} GiB)"

#: What a trace on the CPU cannot see on a GPU: the CUDA context (0.5-0.9 GiB) and NCCL's
#: buffers after the first collective (~1-2 GiB, measured +1.45 GiB; ml-engineering's notes).
GPU_OVERHEAD = 1.5 * GB
#: The formula's activations under activation checkpointing: a third of the allowance (measured
#: by the tracer on LLaMA-7B/13B shapes: 12.0 -> at most 3.1 GiB and 18.9 -> at most 6.0 GiB;
#: docs/train.md).
CHECKPOINTED_ACTIVATIONS = 1 / 3
#: The formula's largest sharding unit when the model is not known: 5% of the parameters (a
#: block of a 20-block model; the LLaMA-7B block is 3%).
ASSUMED_UNIT_SHARE = 0.05

#: The layouts the planner compares: (strategy, activation checkpointing).
OPTIONS: dict[str, tuple[str, bool]] = {
    "ddp": ("ddp", False), "ddp+ac": ("ddp", True),
    "fsdp": ("fsdp", False), "fsdp+ac": ("fsdp", True),
}


def option_name(strategy: str, checkpointed: bool) -> str:
    """``fsdp+ac`` for FSDP with activation checkpointing, and so on."""
    return strategy + ("+ac" if checkpointed else "")


def options_for(train: TrainSpec) -> list[str]:
    """The layouts to try, in order: the job's own, or under ``auto`` DDP, then FSDP, then FSDP
    with activation checkpointing (the first that fits wins)."""
    checkpointed = train.activation_checkpointing is not False
    if train.strategy != "auto":
        return [option_name(train.strategy, checkpointed)]
    return list(dict.fromkeys([option_name("ddp", checkpointed),
                               option_name("fsdp", checkpointed), "fsdp+ac"]))


@dataclass(frozen=True)
class TracedPeak:
    """One traced step's peak on one rank, in bytes by what holds them (at ``world_size`` ranks
    and ``batch`` samples per rank). Crosses from the model probe to the plan as JSON."""

    option: str
    world_size: int
    batch: int
    weights: float  # parameters (FSDP: this rank's shards)
    gradients: float
    optimizer: float
    gathered: float  # FSDP's gathered parameters, unsharded gradients, buffers; DDP: buffers
    activations: float  # activations, temporaries and inputs at the peak
    seconds: float = 0.0
    #: The same five parts at the moment the unsharded parts were largest (the end of the
    #: forward pass, usually): at another world size it can be the peak
    busiest: tuple[float, ...] = ()

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.gathered + self.activations

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TracedPeak:
        values = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        values["busiest"] = tuple(float(v) for v in values.get("busiest") or ())
        return cls(**values)

    def moments(self) -> list[TracedPeak]:
        """The peak, and the busiest moment when it was recorded, as peaks."""
        if len(self.busiest) != 5:
            return [self]
        weights, gradients, optimizer, gathered, activations = self.busiest
        return [self, replace(self, weights=weights, gradients=gradients, optimizer=optimizer,
                              gathered=gathered, activations=activations, busiest=())]


@dataclass(frozen=True)
class ModelFacts:
    """What ``load`` learned by building the job's model on the meta device and tracing it."""

    params: float
    largest_unit: float | None = None  # parameters of the largest sharding unit
    wrap_classes: tuple[str, ...] = ()  # the classes fsdp.wrap resolves to
    classes: tuple[str, ...] = ()  # module classes of the model that hold parameters
    batchnorm: tuple[str, ...] = ()  # batch-norm classes found (statistics per local batch)
    traced: tuple[TracedPeak, ...] = ()
    notes: tuple[str, ...] = ()  # why an estimate is a formula's, when one was wanted traced

    def trace(self, option: str) -> TracedPeak | None:
        """The traced peak of ``option``, if one was traced."""
        return next((t for t in self.traced if t.option == option), None)

    def with_trace(self, peak: TracedPeak) -> ModelFacts:
        return replace(self, traced=(*[t for t in self.traced if t.option != peak.option], peak))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["traced"] = [t.to_json() for t in self.traced]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelFacts:
        return cls(
            params=float(data["params"]), largest_unit=data.get("largest_unit"),
            wrap_classes=tuple(data.get("wrap_classes", ())),
            classes=tuple(data.get("classes", ())), batchnorm=tuple(data.get("batchnorm", ())),
            traced=tuple(TracedPeak.from_json(t) for t in data.get("traced", ())),
            notes=tuple(data.get("notes", ())),
        )


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's bytes, by what holds them, under one layout."""

    params: float
    weights: float
    gradients: float
    buckets: float
    optimizer: float
    activations: float
    optimizer_name: str
    precision: str
    gathered: float = 0.0
    overhead: float = 0.0
    option: str = "ddp"
    method: str = "formula"
    autocast: float = 0.0  # autocast's low-precision copies of the weights, alive at the peak

    @property
    def before_activations(self) -> float:
        """The model states and the strategy's buffers: everything but activations and the
        fixed overhead."""
        return self.weights + self.gradients + self.buckets + self.optimizer + self.gathered

    @property
    def total(self) -> float:
        """The per-rank need."""
        return self.before_activations + self.activations + self.autocast + self.overhead

    def parts(self) -> dict[str, float]:
        """The parts in GB, for tables and JSON."""
        names = ("weights", "gradients", "buckets", "optimizer", "gathered", "activations",
                 "autocast", "overhead")
        return {name: round(getattr(self, name) / GB, 3) for name in names}

    def biggest_text(self) -> str:
        """``optimizer state 13.4 GB of 25.7``: the biggest part of the need."""
        name, size = biggest_part(self.parts())
        return f"{name} {size:.1f} GB of {self.total / GB:.1f}"

    def describe(self) -> str:
        """One sentence with the numbers, e.g. for a refusal."""
        opt = {"adamw": "AdamW", "sgd": "SGD"}.get(self.optimizer_name, self.optimizer_name)
        kept = "DDP buckets" if self.option.startswith("ddp") else "gathered units"
        extra = self.buckets if self.option.startswith("ddp") else self.gathered
        return (
            f"{count_text(self.params)} parameters with {opt} in {self.precision} need "
            f"~{self.before_activations / GB:.0f} GB per GPU before activations under "
            f"{self.option} (weights {self.weights / GB:.1f}, gradients "
            f"{self.gradients / GB:.1f}, {kept} {extra / GB:.1f}, optimizer "
            f"{self.optimizer / GB:.1f}) + {self.activations / GB:.1f} GB "
            + ("of activations traced" if self.method == "traced" else
               "allowed for activations")
            + (f" + {self.autocast / GB:.1f} GB of autocast's copies of the weights"
               if self.autocast else "")
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MemoryEstimate:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


#: The parts of a need as the plan names them (``MemoryEstimate.parts`` keys -> words).
PART_NAMES = {"weights": "weights", "gradients": "gradients", "optimizer": "optimizer state",
              "working": "working set", "activations": "activations",
              "autocast": "autocast cache", "overhead": "GPU overhead"}


def biggest_part(parts: Mapping[str, float]) -> tuple[str, float]:
    """The biggest part of a need (``parts`` in GB, as :meth:`MemoryEstimate.parts` gives them)
    and its size: weights, gradients, optimizer state, the working set (DDP's buckets, FSDP's
    gathered units), activations, autocast's copies of the weights (a mixed precision without
    activation checkpointing, docs/train.md), or the GPU overhead."""
    merged = {k: float(parts.get(k, 0.0)) for k in PART_NAMES if k != "working"}
    merged["working"] = float(parts.get("buckets", 0.0)) + float(parts.get("gathered", 0.0))
    name = max(merged, key=lambda k: merged[k])
    return PART_NAMES[name], merged[name]


def count_text(params: float) -> str:
    """``6.7e9`` (as people write model sizes), not Python's ``6.7e+09``."""
    text = f"{params:.3g}"
    mantissa, sep, exponent = text.partition("e")
    return f"{mantissa}e{int(exponent)}" if sep else text


def _state_bytes(train: TrainSpec, params: float) -> tuple[float, float, float]:
    """Weights, gradients and optimizer state of ``params`` parameters, unsharded."""
    width = 2 if train.param_dtype == "bfloat16" else 4
    if train.optimizer.name == "adamw":
        optimizer = 2 * params * width  # exp_avg and exp_avg_sq
    elif train.optimizer.momentum > 0:
        optimizer = params * width  # momentum buffer
    else:
        optimizer = 0.0
    return params * width, params * width, optimizer


def autocast_cache(train: TrainSpec, params: float, checkpointed: bool) -> float:
    """Bytes of autocast's low-precision copies of the weights alive at the end of the forward
    pass: 2 a parameter, the whole model's even under FSDP (each unit's copy is cached and kept
    for its backward while the unit's own gathered weights are freed), under a mixed precision
    without activation checkpointing (with it the trainer turns autocast's cache off:
    orchestrate/train/precision.py). Traced on a LLaMA-7B shape under FSDP at the end of the
    forward pass: activations 17.0 GB at bf16-mixed, 13.5 GB of them these copies
    (2 x 6.74e9); with checkpointing 13.6 GB with the cache on, 1.7 with it off; FSDP's own mixed
    precision (``fsdp: {mixed_precision: bf16}``, no autocast) has none (docs/train.md)."""
    if train.autocast_dtype is None or checkpointed:
        return 0.0
    return 2.0 * params


def estimate(train: TrainSpec, params: float) -> MemoryEstimate:
    """Per-GPU memory of DDP training ``params`` parameters with ``train``'s settings, at its
    per-rank batch (the formula)."""
    return formula(train, params, option="ddp", world=1, batch=None)


@dataclass(frozen=True)
class RankShape:
    """Where one rank's estimate is made: the world size, its batch, and whether it is a GPU."""

    world: int
    batch: int | None = None  # None: train.batch_size
    gpu: bool = True
    reference_batch: float | None = None  # the batch the activation allowance is for


def formula(train: TrainSpec, params: float, *, option: str, world: int, batch: int | None,
            gpu: bool = True, largest_unit: float | None = None,
            reference_batch: float | None = None) -> MemoryEstimate:
    """The formula's estimate of one rank under ``option`` at ``world`` ranks and ``batch``
    samples (None: ``train.batch_size``), the activation allowance being for
    ``reference_batch`` samples (default: ``train.batch_size``)."""
    strategy, checkpointed = OPTIONS[option]
    weights, gradients, optimizer = _state_bytes(train, params)
    reference = reference_batch or train.batch_size
    samples = reference if batch is None else batch
    activations = train.activation_memory_gb * GB * samples / reference
    if checkpointed:
        activations *= CHECKPOINTED_ACTIVATIONS
    cache = autocast_cache(train, params, checkpointed)
    buckets = gathered = 0.0
    if strategy == "ddp":
        buckets = 0.0 if train.gradient_as_bucket_view else gradients
    else:
        world = max(1, world)
        unit = largest_unit if largest_unit else params * ASSUMED_UNIT_SHARE
        width = weights / params if params else 4.0
        gather_width = 2.0 if train.fsdp.mixed_precision == "bf16" else width
        held = params if not train.fsdp.reshard_after_forward else 2 * unit
        gathered = held * gather_width + 2 * unit * width  # + unsharded grads, scatter output
        weights, gradients, optimizer = weights / world, gradients / world, optimizer / world
        if train.fsdp.cpu_offload and gpu:
            weights = gradients = optimizer = 0.0  # on the host
    return MemoryEstimate(
        params=params, weights=weights, gradients=gradients, buckets=buckets,
        optimizer=optimizer, activations=activations, optimizer_name=train.optimizer.name,
        precision=train.precision, gathered=gathered, overhead=0.0, option=option,
        autocast=cache,
    )


def from_trace(train: TrainSpec, params: float, peak: TracedPeak, *, world: int,
               batch: int | None, gpu: bool = True) -> MemoryEstimate:
    """A traced peak carried over to ``world`` ranks and ``batch`` samples per rank (FSDP's
    shards scale as 1/world, activations with the samples), plus what the trace cannot see:
    DDP's buckets without ``gradient_as_bucket_view``, and the GPU overhead. Of the traced
    moments (the peak, the busiest one) the larger once carried over."""
    return max((_carried(train, params, moment, world=world, batch=batch, gpu=gpu)
                for moment in peak.moments()), key=lambda e: e.total)


def _carried(train: TrainSpec, params: float, peak: TracedPeak, *, world: int,
             batch: int | None, gpu: bool) -> MemoryEstimate:
    strategy, checkpointed = OPTIONS[peak.option]
    samples = train.batch_size if batch is None else batch
    shard = peak.world_size / max(1, world) if strategy == "fsdp" else 1.0
    weights, gradients, optimizer = (peak.weights * shard, peak.gradients * shard,
                                     peak.optimizer * shard)
    if strategy == "fsdp" and train.fsdp.cpu_offload and gpu:
        weights = gradients = optimizer = 0.0
    buckets = 0.0
    if strategy == "ddp" and not train.gradient_as_bucket_view:
        buckets = _state_bytes(train, params)[1]
    # The traced activations hold autocast's copies of the weights at the end of the forward
    # pass (a moment whose activations are at least that much): they do not grow with the
    # batch, so they are kept apart.
    cache = autocast_cache(train, params, checkpointed)
    if peak.activations < cache:
        cache = 0.0
    return MemoryEstimate(
        params=params, weights=weights, gradients=gradients, buckets=buckets,
        optimizer=optimizer,
        activations=(peak.activations - cache) * samples / max(1, peak.batch),
        optimizer_name=train.optimizer.name, precision=train.precision,
        gathered=peak.gathered, overhead=GPU_OVERHEAD if gpu else 0.0, option=peak.option,
        method="traced", autocast=cache,
    )


def rank_estimate(train: TrainSpec, facts: ModelFacts, option: str, shape: RankShape
                  ) -> MemoryEstimate:
    """One rank's estimate under ``option``: traced when the probe traced it, else the formula
    (with the model's largest unit when it is known)."""
    peak = facts.trace(option)
    if peak is not None:
        return from_trace(train, facts.params, peak, world=shape.world, batch=shape.batch,
                          gpu=shape.gpu)
    return formula(train, facts.params, option=option, world=shape.world, batch=shape.batch,
                   gpu=shape.gpu, largest_unit=facts.largest_unit,
                   reference_batch=shape.reference_batch)


def max_batch(train: TrainSpec, facts: ModelFacts, option: str, shape: RankShape,
              capacity: float | None) -> int | None:
    """The largest per-rank batch whose estimate fits ``capacity`` bytes (None: no bound; 0:
    not even one sample)."""
    if capacity is None:
        return None
    empty = rank_estimate(train, facts, option, replace(shape, batch=0))
    one = rank_estimate(train, facts, option, replace(shape, batch=1))
    per_sample = one.total - empty.total
    room = capacity - empty.total
    if room < 0:
        return 0
    if per_sample <= 0:
        return None
    cap = math.floor(room / per_sample + 1e-9)

    def fits(samples: int) -> bool:
        return rank_estimate(train, facts, option, replace(shape, batch=samples)
                             ).total <= capacity

    # Two traced moments make the need piecewise linear in the batch: when the other moment
    # overtakes below the cap, the largest batch that fits is searched for (0 fits: room >= 0).
    if fits(cap):
        return cap
    low, high = 0, cap - 1
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


@dataclass(frozen=True)
class HostNeed:
    """Host memory one node needs while the ranks build and load the model."""

    node: str
    need: float
    capacity: float | None

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.need <= self.capacity


def host_need(train: TrainSpec, params: float, option: str, *, nproc: int, world: int,
              first_node: bool) -> float:
    """Bytes of host memory a GPU node needs at load: under DDP every rank materialises the
    fp32 (or bf16) weights; under FSDP only rank 0 does (it broadcasts them), and with CPU
    offload every rank keeps its shards of the states on the host."""
    weights, gradients, optimizer = _state_bytes(train, params)
    strategy, _ = OPTIONS[option]
    if strategy == "ddp":
        return nproc * weights
    need = weights if first_node else 0.0
    if train.fsdp.cpu_offload:
        need += nproc * (weights + gradients + optimizer) / max(1, world)
    return need


def remedies(train: TrainSpec) -> str:
    """What a person can do when the model does not fit."""
    options = ["a GPU model with more memory (resources.gpu_model)"]
    if train.strategy == "ddp":
        options.append("train.strategy: fsdp (or auto): shard the states over the ranks "
                       "instead of a replica on each (FSDP/ZeRO-3)")
    if train.activation_checkpointing is False:
        options.append("train.activation_checkpointing: true (recompute activations)")
    if not train.gradient_as_bucket_view and train.strategy == "ddp":
        options.append("train.gradient_as_bucket_view: true (drops a gradient-sized copy)")
    if train.param_dtype != "bfloat16":
        options.append("train.precision: bf16-true (halves weights, gradients, optimizer)")
    if train.optimizer.name == "adamw":
        options.append("optimizer sgd (AdamW keeps two states per parameter)")
    options.append("more GPUs (resources.nodes), or a smaller batch")
    return "; ".join(options)


__all__ = [
    "GB",
    "GIB",
    "GPU_OVERHEAD",
    "HostNeed",
    "MemoryEstimate",
    "ModelFacts",
    "RankShape",
    "TracedPeak",
    "biggest_part",
    "capacity_bytes",
    "capacity_text",
    "count_text",
    "estimate",
    "formula",
    "from_trace",
    "host_need",
    "max_batch",
    "option_name",
    "options_for",
    "rank_estimate",
    "remedies",
]
