"""The strategy and the batch shares of a placed job: what each rank keeps and how much it takes.

Pure. Once the ranks are placed, each layout the job allows (its ``strategy``, or under
``auto`` DDP, then FSDP, then FSDP with activation checkpointing) is estimated on every rank
(:mod:`orchestrate.core.plan.memory`): the rank's memory cap (the largest batch that fits its
GPU, or its share of its node's memory on a CPU node), the split of the global batch under those
caps (:mod:`orchestrate.core.plan.shares`), then each rank's peak at its share and each node's
host memory at load. The first layout under which every rank and node fits is the plan's; when
none does, the refusal shows every layout's numbers.

Without a model size (no ``model_params``, a model that could not be counted) nothing is
estimated: ``auto`` means DDP, and shares are not capped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orchestrate.core.errors import UserError
from orchestrate.core.plan import advice
from orchestrate.core.plan import shares as batch
from orchestrate.core.plan.memory import (
    GB,
    OPTIONS,
    HostNeed,
    MemoryEstimate,
    ModelFacts,
    RankShape,
    capacity_bytes,
    capacity_text,
    count_text,
    host_need,
    max_batch,
    options_for,
    rank_estimate,
)

if TYPE_CHECKING:  # annotations only: planning values need no pydantic import
    from orchestrate.core.spec.job import JobSpec
    from orchestrate.core.spec.trainspec import TrainSpec


@dataclass(frozen=True)
class Slot:
    """One placed rank, as the decision sees it."""

    rank: int
    node: str
    kind: str  # the GPU model, or "cpu"
    capacity: float | None  # bytes this rank may use (None: not known)
    speed: float | None  # relative throughput (TFLOPS), None when not known
    node_index: int = 0
    node_ranks: int = 1
    host_capacity: float | None = None  # the node's host memory in bytes, when known

    @property
    def gpu(self) -> bool:
        return self.kind != "cpu"


@dataclass(frozen=True)
class RankMemory:
    """One rank's estimate under the plan's layout, at its share."""

    rank: int
    kind: str
    batch: int
    peak_gb: float
    capacity_gb: float | None
    cap: int | None  # the largest batch that fits

    @property
    def fits(self) -> bool | None:
        return None if self.capacity_gb is None else self.peak_gb <= self.capacity_gb

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "kind": self.kind, "batch": self.batch,
                "peak_gb": self.peak_gb, "capacity_gb": self.capacity_gb, "cap": self.cap,
                "fits": self.fits}


@dataclass(frozen=True)
class Estimate:
    """One row of the plan's memory table: a layout on one GPU model (its worst rank)."""

    strategy: str  # the layout: ddp, ddp+ac, fsdp, fsdp+ac
    gpu_model: str  # or "cpu"
    peak_gb: float
    capacity_gb: float | None
    fits: bool | None
    method: str  # traced | formula
    parts: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "gpu_model": self.gpu_model, "peak_gb": self.peak_gb,
                "capacity_gb": self.capacity_gb, "fits": self.fits, "method": self.method,
                "parts": dict(self.parts)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Estimate:
        return cls(str(data["strategy"]), str(data["gpu_model"]), float(data["peak_gb"]),
                   data.get("capacity_gb"), data.get("fits"), str(data["method"]),
                   dict(data.get("parts") or {}))


@dataclass(frozen=True)
class MemoryPlan:
    """The layout the plan runs, every layout's estimates, and each rank's (``plan --json``
    "memory")."""

    layout: str  # ddp | ddp+ac | fsdp | fsdp+ac
    estimates: tuple[Estimate, ...]
    ranks: tuple[RankMemory, ...] = ()
    params: float | None = None
    notes: tuple[str, ...] = ()

    @property
    def strategy(self) -> str:
        return OPTIONS[self.layout][0]

    @property
    def activation_checkpointing(self) -> bool:
        return OPTIONS[self.layout][1]

    @property
    def total(self) -> float:
        """The largest need of any rank under the plan's layout, in bytes."""
        return max((e.peak_gb for e in self.estimates if e.strategy == self.layout),
                   default=0.0) * GB

    def to_json(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "layout": self.layout,
                "activation_checkpointing": self.activation_checkpointing,
                "params": self.params, "estimates": [e.to_json() for e in self.estimates],
                "ranks": [r.to_json() for r in self.ranks], "notes": list(self.notes)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MemoryPlan:
        ranks = tuple(RankMemory(int(r["rank"]), str(r["kind"]), int(r["batch"]),
                                 float(r["peak_gb"]), r.get("capacity_gb"), r.get("cap"))
                      for r in data.get("ranks", ()))
        return cls(str(data["layout"]), tuple(Estimate.from_json(e) for e in data["estimates"]),
                   ranks, data.get("params"), tuple(data.get("notes", ())))


@dataclass(frozen=True)
class Tried:
    """One layout's outcome: the shares, each rank's estimate, and why it does not fit."""

    layout: str
    shares: tuple[int, ...]
    caps: tuple[int | None, ...]
    ranks: tuple[tuple[Slot, MemoryEstimate], ...]
    hosts: tuple[HostNeed, ...]
    problem: str = ""
    split: batch.BatchShares | None = None

    @property
    def fits(self) -> bool:
        return not self.problem


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` settled."""

    memory: MemoryPlan | None
    shares: batch.BatchShares | None
    per_rank_batch: tuple[int, ...]
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def decide(train: TrainSpec, facts: ModelFacts | None, slots: Sequence[Slot],
           source: str) -> Decision:
    """The layout and the shares of a placed job, or a :class:`UserError` that shows each
    layout's numbers."""
    world = len(slots)
    notes: list[str] = []
    warnings: list[str] = []
    if facts is None:
        if train.strategy == "auto":
            notes.append("strategy auto: the model's size is not known (set train.model_params, "
                         "or plan where torch is installed), so ddp")
        shares = _split(train, slots, [None] * world, source)
        return Decision(None, shares, _per_rank(train, shares, world), tuple(warnings),
                        tuple(notes))
    tried = [_try(train, facts, slots, layout, source) for layout in options_for(train)]
    chosen = next((t for t in tried if t.fits), None)
    if chosen is None:
        raise _refusal(train, facts, tried, source, _fitting(train, facts, slots, source))
    shares = chosen.split
    if shares is not None and facts.batchnorm and (
            len(set(shares.shares)) > 1 or shares.split == "measured"):
        warnings.append(
            f"the model has batch norm ({', '.join(facts.batchnorm)}): its statistics are per "
            "local batch, so ranks with different shares normalise over different numbers of "
            "samples (SyncBatchNorm, which handles uneven counts, needs GPUs)")
    if chosen.layout.startswith("fsdp") and len({s.kind for s in slots}) > 1:
        notes.append("FSDP shards the parameters evenly, so its memory is bounded by the "
                     "smallest GPU (the larger ones hold the same shards; a global batch split "
                     "by speed gives them larger batches)")
    # Each rank's line only where ranks differ by design (a split global batch); otherwise
    # the table's worst rank per GPU model says it all.
    per_rank = () if shares is None else tuple(
        _rank_memory(s, e, b, c)
        for (s, e), b, c in zip(chosen.ranks, chosen.shares, chosen.caps, strict=True))
    memory = MemoryPlan(chosen.layout, tuple(row for t in tried for row in _rows(t)), per_rank,
                        facts.params, tuple(facts.notes))
    return Decision(memory, shares, chosen.shares, tuple(warnings), tuple(notes))


def _per_rank(train: TrainSpec, shares: batch.BatchShares | None, world: int) -> tuple[int, ...]:
    return shares.shares if shares is not None else (train.batch_size,) * world


def _try(train: TrainSpec, facts: ModelFacts, slots: Sequence[Slot], layout: str,
         source: str) -> Tried:
    world = len(slots)
    reference = (train.global_batch_size / world if train.global_batch_size is not None
                 else float(train.batch_size))
    # Ranks alike (same GPU model and memory, same batch) are estimated once: a 4,096-node
    # plan has 32,768 ranks and a handful of kinds.
    cap_of: dict[tuple[bool, float | None], int | None] = {}
    for slot in slots:
        if (slot.gpu, slot.capacity) not in cap_of:
            shape = RankShape(world=world, gpu=slot.gpu, reference_batch=reference)
            cap_of[slot.gpu, slot.capacity] = max_batch(train, facts, layout, shape,
                                                        slot.capacity)
    caps = tuple(cap_of[s.gpu, s.capacity] for s in slots)
    problem = ""
    split: batch.BatchShares | None = None
    try:
        split = _split(train, slots, list(caps), source)
        per_rank = _per_rank(train, split, world)
    except batch.NoSplit as why:  # estimated at the equal share, to show by how much
        problem = str(why)
        per_rank = (math.ceil(reference),) * world
    estimate_of: dict[tuple[bool, int], MemoryEstimate] = {}
    for slot, b in zip(slots, per_rank, strict=True):
        if (slot.gpu, b) not in estimate_of:
            estimate_of[slot.gpu, b] = rank_estimate(train, facts, layout, RankShape(
                world=world, batch=b, gpu=slot.gpu, reference_batch=reference))
    ranks = tuple((slot, estimate_of[slot.gpu, b]) for slot, b in zip(slots, per_rank,
                                                                      strict=True))
    hosts = _hosts(train, facts, layout, slots)
    over = []
    for kind in dict.fromkeys(s.kind for s in slots):
        mine = [(s, e) for s, e in ranks if s.kind == kind and s.capacity is not None]
        short = [(s, e) for s, e in mine if e.total > (s.capacity or 0)]
        if short:
            slot, worst = max(short, key=lambda pair: pair[1].total)
            over.append(f"{len(short)} {kind} rank(s) need up to {worst.total / GB:.1f} GB of "
                        f"{capacity_text(slot.capacity or 0)}")
    over += [f"node {h.node} needs {h.need / GB:.1f} GB of host memory to load the model, "
             f"has {capacity_text(h.capacity or 0)}" for h in hosts if not h.fits]
    if over:
        numbers = "; ".join(over[:4])
        problem = f"{problem} (at an equal share: {numbers})" if problem else numbers
    return Tried(layout, per_rank, caps, ranks, hosts, problem=problem, split=split)


def _hosts(train: TrainSpec, facts: ModelFacts, layout: str,
           slots: Sequence[Slot]) -> tuple[HostNeed, ...]:
    """Host memory at load, for the GPU nodes whose memory the inventory gives."""
    seen: dict[str, Slot] = {}
    for slot in slots:
        seen.setdefault(slot.node, slot)
    return tuple(
        HostNeed(node, host_need(train, facts.params, layout, nproc=slot.node_ranks,
                                 world=len(slots), first_node=slot.node_index == 0),
                 slot.host_capacity)
        for node, slot in seen.items() if slot.gpu and slot.host_capacity is not None)


def _split(train: TrainSpec, slots: Sequence[Slot], caps: list[int | None],
           source: str) -> batch.BatchShares | None:
    """The global batch split under ``caps`` (None for a per-rank ``batch_size``; a per-rank
    batch above a cap raises :class:`~orchestrate.core.plan.shares.NoSplit`)."""
    total = train.global_batch_size
    if total is None:
        short: dict[int, list[int]] = {}  # the cap -> the ranks it holds
        for r, c in enumerate(caps):
            if c is not None and c < train.batch_size:
                short.setdefault(c, []).append(r)
        if short:
            raise batch.NoSplit("; ".join(
                f"{_ranks_text(ranks)}'s memory holds {c} samples, batch_size is "
                f"{train.batch_size}" for c, ranks in sorted(short.items())))
        return None
    micro = total // train.grad_accum_steps
    how = train.batch_split
    speeds = [1.0] * len(slots)
    if train.batch_shares is not None:
        given = train.batch_shares
        try:
            batch.manual(micro, given, [None] * len(slots))
        except batch.NoSplit as why:  # a mistake whatever the memory: say it as one
            raise UserError.single(str(why), source=source, field="train.batch_shares",
                                   got=given, hint=f"{len(slots)} shares adding up to {micro}"
                                   ) from None
        shares = batch.manual(micro, given, caps)
        return batch.BatchShares(total, "manual", tuple(shares), tuple(caps), tuple(speeds))
    if micro < len(slots):
        raise UserError.single(
            f"a global batch of {micro} samples per micro-step cannot give each of the "
            f"{len(slots)} ranks a sample", source=source, field="train.global_batch_size",
            got=total, hint=f"at least {len(slots) * train.grad_accum_steps}")
    if how == "proportional" or (how == "measured" and all(s.gpu for s in slots)):
        speeds = _speeds(slots, source)
    shares = batch.apportion(micro, speeds, caps)
    return batch.BatchShares(total, how, tuple(shares), tuple(caps), tuple(speeds))


def _ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0-5``, ``ranks 0, 2, 4``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _speeds(slots: Sequence[Slot], source: str) -> list[float]:
    """Each rank's relative speed: its GPU's (CPU ranks all alike)."""
    unknown = sorted({s.kind for s in slots if s.gpu and s.speed is None})
    if unknown:
        raise UserError.single(
            f"no speed is known for GPU model(s) {', '.join(unknown)}, so a proportional "
            "split cannot be computed", source=source, field="train.batch_split",
            got="proportional", hint="give the GPUs' dense TFLOPS in the inventory "
            "(gpus: [{model: ..., tflops: 150}]), or use batch_split: measured")
    return [1.0 if not s.gpu or s.speed is None else float(s.speed) for s in slots]


def _rank_memory(slot: Slot, est: MemoryEstimate, share: int, cap: int | None) -> RankMemory:
    return RankMemory(slot.rank, slot.kind, share, round(est.total / GB, 3),
                      None if slot.capacity is None else round(slot.capacity / GB, 3), cap)


def _rows(tried: Tried) -> list[Estimate]:
    """The layout's worst rank per GPU model (or its refusal, when it could not be split)."""
    rows: list[Estimate] = []
    kinds = dict.fromkeys(s.kind for s, _ in tried.ranks)
    for kind in kinds:
        mine = [(s, e) for s, e in tried.ranks if s.kind == kind]
        _slot, worst = max(mine, key=lambda pair: pair[1].total)
        capacity = min((s.capacity for s, _ in mine if s.capacity is not None), default=None)
        fits = None if capacity is None else all(
            s.capacity is None or e.total <= s.capacity for s, e in mine)
        rows.append(Estimate(tried.layout, kind, round(worst.total / GB, 3),
                             None if capacity is None else round(capacity / GB, 3), fits,
                             worst.method, worst.parts()))
    return rows


def _fitting(train: TrainSpec, facts: ModelFacts, slots: Sequence[Slot],
             source: str) -> list[advice.Found]:
    """The changes to the job that fit the placed ranks (:mod:`~orchestrate.core.plan.advice`),
    each under the first of its layouts that fits."""
    found: list[advice.Found] = []
    for change in advice.changes(train, any(s.gpu for s in slots)):
        known = advice.facts_for(change, facts)
        for layout in options_for(change.train):
            tried = _try(change.train, known, slots, layout, source)
            if tried.fits:
                slot, worst = max(tried.ranks, key=lambda pair: pair[1].total / (
                    pair[0].capacity or float("inf")))
                found.append(advice.Found(change, layout, worst.total, slot.capacity or 0.0,
                                          slot.kind, worst.method))
                break
    return found


def _refusal(train: TrainSpec, facts: ModelFacts, tried: list[Tried], source: str,
             found: list[advice.Found]) -> UserError:
    lines = []
    for t in tried:
        worst = max(t.ranks, key=lambda pair: pair[1].total)[1]
        method = "formula, a lower bound" if worst.method == "formula" else worst.method
        detail = f"{method}; {worst.describe()}" if t is tried[0] else method
        lines.append(f"{t.layout}: {t.problem} ({detail}; the biggest part: "
                     f"{worst.biggest_text()})")
    return UserError.single(
        f"the model ({count_text(facts.params)} parameters) fits no layout the job allows: "
        + " | ".join(lines), source=source, field="train",
        hint=advice.hint(found, "more GPUs (resources.nodes), a GPU model with more memory "
                                "(resources.gpu_model), or a smaller batch"))


def slots_for(numbered: Sequence[Any]) -> list[Slot]:
    """The decision's view of the placed ranks (``numbered``: the
    :class:`~orchestrate.core.plan.ranks.NodeRanks` of the placement, in plan order)."""
    slots: list[Slot] = []
    for nr in numbered:
        node, gpus, nproc = nr.choice.node, nr.choice.gpus, nr.choice.nproc
        host = None if node.host_memory_gb is None else capacity_bytes(node.host_memory_gb)
        for rank in nr.ranks:
            gpu = gpus[rank.local_rank] if gpus else None
            if gpu is None:
                slots.append(Slot(rank.rank, node.name, "cpu",
                                  None if host is None else host / nproc, None,
                                  nr.node_rank, nproc, host))
                continue
            speed = gpu.tflops if gpu.tflops is not None else batch.known_speed(gpu.model)
            slots.append(Slot(rank.rank, node.name, gpu.model, capacity_bytes(gpu.memory_gb), speed,
                              nr.node_rank, nproc, host))
    return slots


def resolved_config(config: dict[str, Any], decision: Decision) -> dict[str, Any]:
    """The train.json of the plan: the job's ``train:`` section with what the planner settled
    (the layout ``auto`` chose, the batch shares) written in, so every rank runs exactly what
    ``plan`` showed."""
    out = dict(config)
    if decision.memory is not None:
        out["strategy"] = decision.memory.strategy
        if decision.memory.activation_checkpointing and out.get("activation_checkpointing") in (
                False, None):
            out["activation_checkpointing"] = True
    elif out.get("strategy") == "auto":
        out["strategy"] = "ddp"
    if decision.shares is not None:
        out["batch_plan"] = {"shares": list(decision.shares.shares),
                             "caps": list(decision.shares.caps)}
    return out


def model_facts(job: JobSpec, model: ModelFacts | None, param_count: float | None,
                source: str) -> ModelFacts | None:
    """What is known of the model: what ``load`` found, else its size alone; None for a
    ``command:`` job or a model of unknown size. The train section's combinations are checked
    here, once."""
    if job.train is None:
        return None
    from orchestrate.core.spec.trainspec import combination_problems  # a job: pydantic is in

    problems = combination_problems(job.train, source)
    if problems:
        raise UserError(problems)
    if model is not None:
        return model
    params = param_count if param_count is not None else job.train.model_params
    return None if params is None else ModelFacts(params=params)


def placement_need(job: JobSpec, model: ModelFacts | None) -> MemoryEstimate | None:
    """The per-GPU need the placement filters GPUs by: DDP's replica at the per-rank batch, for
    a job that asks for DDP with a per-rank batch (every other layout is checked once placed)."""
    if job.train is None or model is None or job.train.strategy != "ddp":
        return None
    if job.train.global_batch_size is not None:
        return None
    return rank_estimate(job.train, model, options_for(job.train)[0], RankShape(world=1))
