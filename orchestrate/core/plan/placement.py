"""Placement: which nodes and which GPUs (or CPU slots) a job gets, or why it cannot have any.

The planner's search, pure: the job's resources, the inventory and what other jobs hold in
(``busy``), out come the chosen nodes in plan order with their GPUs, or a :class:`UserError`
that says what came closest and why each node was refused; when the job would fit if other jobs
held nothing, its problems are marked ``busy`` (exit 75, "try again later", not 2). Rank
numbering is :mod:`orchestrate.core.plan.ranks`' business; this module only decides where.

The rules: GPU models are never mixed across ranks unless the job allows it (``allow_mixed_gpus``,
or a global batch split by speed, which is made for mixed GPUs; then any GPU model, but never GPU
and CPU-only nodes in one job: nccl needs a GPU per rank); without a model named,
each model of the inventory is tried in inventory order and the first that yields enough nodes
wins; CPU-only nodes are their own kind. A GPU must pass the model and memory filters and hold
the model (the memory estimate), and not be held by another job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from orchestrate.core.errors import UserError
from orchestrate.core.exits import EXIT_BUSY
from orchestrate.core.plan.gpuchoice import choose
from orchestrate.core.plan.memory import (
    MemoryEstimate,
    capacity_bytes,
    capacity_text,
    remedies,
)
from orchestrate.core.spec import hostlist
from orchestrate.core.spec.backendtraits import traits

if TYPE_CHECKING:  # annotations only: planning values need no pydantic import (the
    # supervisor and `status` read a stored plan; docs/performance.md)
    from orchestrate.core.spec.inventory import Gpu, Inventory, Node
    from orchestrate.core.spec.job import JobSpec

#: The "model" the search tries under ``allow_mixed_gpus``: any GPU, of any model.
ANY_GPU = "*"


@dataclass(frozen=True)
class Busy:
    """What other running jobs hold, per node: GPUs (CUDA indices) and CPU slots; and GPUs in
    use outside orchestrate."""

    gpus: Mapping[str, frozenset[int]] = field(default_factory=dict)
    slots: Mapping[str, int] = field(default_factory=dict)
    #: Nodes the job must not use (a restart avoiding the node that failed).
    excluded: frozenset[str] = frozenset()
    #: GPUs with compute processes of no orchestrate job, per node: index -> why, e.g.
    #: "GPU 2 in use by pid 4242 (ben, python3, 30.0 GB)". Busy unless the job shares.
    in_use: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    #: Free memory (GB) of those GPUs: what a sharing job's memory checks compare against.
    free_gb: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    #: Who holds the GPUs other jobs lease, per node: index -> "job J (user, since ...)".
    holders: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    #: Who holds the CPU slots other jobs lease, per node.
    slot_holders: Mapping[str, str] = field(default_factory=dict)
    #: GPUs that failed their health check, per node: index -> the sentence that says why
    #: (:mod:`orchestrate.core.gpuhealth`). Never placed on, whatever the job asks.
    sick: Mapping[str, Mapping[int, str]] = field(default_factory=dict)

    @property
    def anything(self) -> bool:
        """Whether anything at all is held or in use (else a refusal is for good)."""
        return bool(self.gpus or self.slots or self.in_use)


@dataclass(frozen=True)
class Choice:
    """One node of the job: the node, its GPUs (empty on CPU-only nodes), how many ranks."""

    node: Node
    gpus: tuple[Gpu, ...]
    nproc: int
    why: str = ""  # why these GPUs (NUMA node, switch: core/plan/gpuchoice), for `plan`


@dataclass(frozen=True)
class Placement:
    """The chosen nodes in plan order, and what the search has to say about its choice."""

    choices: tuple[Choice, ...]
    notes: tuple[str, ...] = ()

    @property
    def any_gpu(self) -> bool:
        """Whether the ranks drive GPUs."""
        return any(c.gpus for c in self.choices)

    @property
    def models(self) -> list[str]:
        """The GPU models of the ranks, sorted (more than one: models are mixed)."""
        return sorted({g.model for c in self.choices for g in c.gpus})


def place(
    job: JobSpec,
    inventory: Inventory,
    memory: MemoryEstimate | None,
    busy: Busy,
    source: str,
) -> Placement:
    """Choose the nodes and GPUs for ``job``, or raise :class:`UserError` saying why not
    (``busy`` when only what other jobs hold stands in the way)."""
    res = job.resources
    if not traits(job.backend).multi_node and res.nodes > 1:
        raise UserError.single(
            f"the {job.backend} backend runs on this machine only",
            source=source,
            field="resources.nodes",
            got=res.nodes,
            hint="use backend: ssh or slurm for several nodes",
        )
    nodes = candidate_nodes(job, inventory, source)
    if busy.excluded:
        named = [n.name for n in nodes if n.name in busy.excluded]
        if job.resources.node_names is not None and named:
            raise UserError.single(
                f"node(s) {', '.join(named)} are excluded after a failure, and the job names "
                "its nodes", source=source, field="resources.node_names",
                hint="name spare nodes too, or set restart.exclude_failed_node: false",
            )
        nodes = [n for n in nodes if n.name not in busy.excluded]
    models = _models_to_try(job, inventory, nodes, source)
    reasons: dict[str, list[tuple[str, str]]] = {}
    for model in models:
        picked: list[Choice] = []
        why: list[tuple[str, str]] = []
        for node in nodes:
            choice, reason = _fit(job, node, model, memory, busy)
            if choice is None:
                why.append((node.name, reason))
            else:
                picked.append(choice)
            if len(picked) == res.nodes:
                break
        if len(picked) == res.nodes:
            notes: tuple[str, ...] = ()
            if len(models) > 1 and model is not None and model != ANY_GPU:
                notes = (f"picked GPU model {model}; set resources.gpu_model to choose another",)
            return Placement(tuple(picked), notes + _placement_notes(picked)
                             + _around_sick(picked, busy))
        reasons[model or "cpu"] = why
    refusal = _refusal(job, nodes, memory, reasons, source)
    if busy.anything and _fits_when_free(job, inventory, memory, busy, source):
        raise UserError(replace(
            p, busy=True, hint="other jobs hold what it needs now: try again when they end "
            "(`orchestrate list` shows them); the exit status is 75, not 2")
            for p in refusal.problems)
    raise refusal


def _placement_notes(picked: list[Choice]) -> tuple[str, ...]:
    """Why each node got its GPUs (nodes with the same reason share a line)."""
    by_why: dict[str, list[str]] = {}
    for choice in picked:
        if choice.why:
            by_why.setdefault(choice.why, []).append(choice.node.name)
    return tuple(f"placement: {hostlist.compress(names)}: {why}" for why, names in by_why.items())


def check_spare_node(job: JobSpec, inventory: Inventory, memory: MemoryEstimate | None,
                     busy: Busy, source: str) -> None:
    """``restart.exclude_failed_node`` needs a node to go to: one more than the job uses."""
    if not traits(job.backend).multi_node:
        raise UserError.single(
            f"the {job.backend} backend runs on this machine only: there is no other node to "
            "restart on",
            source=source, field="restart.exclude_failed_node", got=True,
            hint="leave it out (a restart reuses this machine)",
        )
    spare = job.model_copy(update={"resources": job.resources.model_copy(
        update={"nodes": job.resources.nodes + 1})})
    try:
        place(spare, inventory, memory, busy, source)
    except UserError as exc:
        held = exc.exit_status == EXIT_BUSY  # the spare is held by other jobs now
        raise UserError.single(
            f"no spare node: the job uses {job.resources.nodes} node(s) and no other node of "
            f"inventory '{inventory.name}' could take a failed one's place"
            + (" (other jobs hold them now)" if held else ""),
            source=source, field="restart.exclude_failed_node", got=True,
            hint="add a node to the inventory (or to resources.node_names), or set it to false "
            "(a restart then reuses the node)", busy=held,
        ) from None


def _fits_when_free(job: JobSpec, inventory: Inventory, memory: MemoryEstimate | None,
                    busy: Busy, source: str) -> bool:
    """Whether the job would be placed if no other job held anything: then a refusal means
    "not now" (exit 75), not "never" (exit 2). Asked only after a refusal."""
    try:
        place(job, inventory, memory, Busy(excluded=busy.excluded, sick=busy.sick), source)
    except UserError:
        return False
    return True


def candidate_nodes(job: JobSpec, inventory: Inventory, source: str) -> list[Node]:
    """The nodes the job may use, in the order it may use them: those it names (hostlists
    allowed, as in the inventory), else the whole inventory."""
    given = job.resources.node_names
    if given is None:
        return list(inventory.nodes)
    try:  # node_names may use hostlists, like the inventory: [gpu[01-04], gpu09]
        names = [name for item in given for name in hostlist.expand(item)]
    except ValueError as exc:
        raise UserError.single(
            str(exc), source=source, field="resources.node_names", got=given
        ) from None
    unknown = [n for n in names if inventory.node(n) is None]
    if unknown:
        raise UserError.single(
            f"node {', '.join(repr(u) for u in unknown[:12])} not in inventory '{inventory.name}'",
            source=source,
            field="resources.node_names",
            hint="nodes there: " + _short_list([n.name for n in inventory.nodes]),
        )
    if len(set(names)) != len(names):
        raise UserError.single(
            "a node is named twice", source=source, field="resources.node_names", got=given
        )
    return [node for node in (inventory.node(name) for name in names) if node is not None]


def _models_to_try(
    job: JobSpec, inventory: Inventory, nodes: list[Node], source: str
) -> list[str | None]:
    """GPU models to try in order (None: CPU-only nodes; ANY_GPU: any model)."""
    res = job.resources
    wanted = res.gpu_model
    if wanted is not None:
        counts = inventory.model_counts()
        if not any(m.lower() == wanted.lower() for m in counts):
            there = ", ".join(f"{m} ({n})" for m, n in counts.items()) or "none (CPU-only)"
            raise UserError.single(
                f"gpu_model '{wanted}' not in inventory '{inventory.name}'; models there: {there}",
                source=source,
                field="resources.gpu_model",
                hint="set resources.gpu_model to one of them, or leave it out",
            )
        return [wanted]
    has_cpu_nodes = any(not n.is_gpu for n in nodes)
    if res.allow_mixed_gpus or balanced_split(job):
        return [ANY_GPU, *([None] if has_cpu_nodes else [])]
    models: list[str | None] = list(dict.fromkeys(g.model for n in nodes for g in n.gpus))
    if has_cpu_nodes:
        models.append(None)
    return models or [None]


def balanced_split(job: JobSpec) -> bool:
    """Whether the job splits a global batch by the ranks' speeds (anything but ``equal``):
    then mixed GPU models train at the speed of their sum and need no permission to mix."""
    train = job.train
    return train is not None and train.global_batch_size is not None and (
        train.split_name != "equal")


def _fit(
    job: JobSpec, node: Node, model: str | None, memory: MemoryEstimate | None, busy: Busy
) -> tuple[Choice | None, str]:
    """The node's share of the job for ``model``, or why it has none."""
    res = job.resources
    if not node.is_gpu:
        if res.gpu_model is not None or res.min_gpu_memory_gb is not None or model is not None:
            return None, "CPU-only"
        held_slots = busy.slots.get(node.name, 0)
        free_slots = max(0, node.capacity - held_slots)
        want = free_slots if res.gpus_per_node == "all" else res.gpus_per_node
        if want == 0 or want > free_slots:
            extra = f" ({held_slots} held by other jobs)" if held_slots else ""
            whom = busy.slot_holders.get(node.name)
            return None, (f"{free_slots} free slots{extra}, {want or 1} requested"
                          + (f"; held by {whom}" if held_slots and whom else ""))
        return Choice(node, (), want), ""
    if model is None:
        return None, "has GPUs (the job runs on CPU-only nodes)"
    gpus = [g for g in node.gpus if model == ANY_GPU or g.model.lower() == model.lower()]
    if not gpus:
        return None, f"no {model} GPU"
    gpus, why = _sized(job, gpus, memory)
    if not gpus:
        return None, why
    sick = busy.sick.get(node.name, {})
    ill = [g for g in gpus if g.index in sick]
    gpus = [g for g in gpus if g.index not in sick]
    taken = busy.gpus.get(node.name, frozenset())
    in_use = busy.in_use.get(node.name, {})
    free_gb = busy.free_gb.get(node.name, {})
    held = [g for g in gpus if g.index in taken]
    used = [g for g in gpus if g.index not in taken and g.index in in_use]
    shared: list[Gpu] = []
    if res.share_gpus and used:  # sized again by the memory those processes leave free
        fitting, _ = _sized(job, [replace(g, memory_gb=free_gb.get(g.index, g.memory_gb))
                                  for g in used], memory)
        shared = [g for g in used if g.index in {f.index for f in fitting}]
    free = [g for g in gpus if g.index not in taken and (g.index not in in_use or g in shared)]
    want = len(free) if res.gpus_per_node == "all" else res.gpus_per_node
    if want == 0 or len(free) < want:
        extra = f" ({len(held)} held by other jobs)" if held else ""
        if ill:
            extra += f" ({len(ill)} failed the health check)"
        reason = f"{len(free)} usable GPU(s){extra}, {want or 1} requested"
        return None, (reason + _whom(node.name, held, used, shared, busy, res.share_gpus)
                      + "".join(f"; {sick[g.index]}" for g in ill))
    if traits(job.backend).scheduler_allocates:  # the scheduler picks a node's GPUs itself
        return Choice(node, tuple(free[:want]), want), ""
    picked = choose(node, free, want, res.placement)
    return Choice(node, picked.gpus, want, picked.why), ""


def _around_sick(picked: list[Choice], busy: Busy) -> tuple[str, ...]:
    """What the plan says about the GPUs it left out because they failed the health check
    (those of the models it chose: another model was never a candidate)."""
    notes = []
    for choice in picked:
        sick = busy.sick.get(choice.node.name, {})
        models = {g.model for g in choice.gpus}
        notes += [f"{choice.node.name}: left out {sick[g.index]}" for g in choice.node.gpus
                  if g.index in sick and g.model in models]
    return tuple(notes)


def _sized(job: JobSpec, gpus: list[Gpu], memory: MemoryEstimate | None
           ) -> tuple[list[Gpu], str]:
    """The GPUs big enough for the job (its memory floor, the model estimate), or why none."""
    res = job.resources
    if res.min_gpu_memory_gb is not None:
        gpus = [g for g in gpus if g.memory_gb >= res.min_gpu_memory_gb]
        if not gpus:
            return [], f"no GPU with at least {res.min_gpu_memory_gb:g} GB"
    if memory is not None:
        fits = [g for g in gpus if capacity_bytes(g.memory_gb) >= memory.total]
        if not fits:
            small = max(gpus, key=lambda g: g.memory_gb)
            return [], (f"model does not fit ({small.model} has "
                        f"{capacity_text(capacity_bytes(small.memory_gb))})")
        gpus = fits
    return gpus, ""


def _whom(node: str, held: list[Gpu], used: list[Gpu], shared: list[Gpu], busy: Busy,
          share: bool) -> str:
    """Who holds the GPUs a node refused: other jobs, and processes outside orchestrate."""
    who = busy.holders.get(node, {})
    parts = sorted({who[g.index] for g in held if g.index in who})
    lines = [f"held by {', '.join(parts)}"] if parts else []
    in_use = busy.in_use.get(node, {})
    free_gb = busy.free_gb.get(node, {})
    for gpu in used:
        if gpu in shared:
            continue
        text = in_use[gpu.index]
        if share:
            text += f": {free_gb.get(gpu.index, 0.0):g} GB free, too little for the job"
        lines.append(text)
    if used and not share:
        lines.append("set resources.share_gpus: true to use GPUs that others' processes use")
    return "".join(f"; {line}" for line in lines)


def wanted_gpus(job: JobSpec, node: Node, memory: MemoryEstimate | None) -> tuple[int, ...]:
    """The GPUs of ``node`` the job could be given were nothing held: what a waiting job's
    ticket names, so that younger jobs leave them alone (every model it may be placed on)."""
    res = job.resources
    gpus = [g for g in node.gpus
            if res.gpu_model is None or g.model.lower() == res.gpu_model.lower()]
    fitting, _ = _sized(job, gpus, memory)
    return tuple(sorted(g.index for g in fitting))


def _refusal(
    job: JobSpec,
    nodes: list[Node],
    memory: MemoryEstimate | None,
    reasons: dict[str, list[tuple[str, str]]],
    source: str,
) -> UserError:
    res = job.resources
    if memory is not None and job.train is not None:
        gpus = [g for n in nodes for g in n.gpus if _eligible(job, g)]
        if gpus and all(capacity_bytes(g.memory_gb) < memory.total for g in gpus):
            biggest = max(gpus, key=lambda g: g.memory_gb)
            return UserError.single(
                f"{memory.describe()}; {biggest.model} has "
                f"{capacity_text(capacity_bytes(biggest.memory_gb))}, "
                "the most of any GPU this job may use",
                source=source,
                field="train",
                hint="try " + remedies(job.train),
            )
    # Show the attempt (GPU model) that came closest; on a tie, the one with more GPUs.
    capacity = {
        kind: sum(
            1 for n in nodes for g in n.gpus if kind in (ANY_GPU, "cpu") or g.model == kind
        )
        for kind in reasons
    }
    best_kind = max(reasons, key=lambda k: (len(nodes) - len(reasons[k]), capacity[k]), default="")
    best = reasons.get(best_kind, [])
    matched = len(nodes) - len(best)
    detail = "; ".join(_group_reasons(best))
    unit = "slots" if best_kind == "cpu" else "GPUs"
    each = f"all {unit}" if res.gpus_per_node == "all" else f"{res.gpus_per_node} {unit}"
    plural = "node" if res.nodes == 1 else "nodes"
    return UserError.single(
        f"{res.nodes} {plural} requested ({each} each), {matched} match"
        + (f": {detail}" if detail else ""),
        source=source,
        field="resources",
        hint="lower resources.nodes or gpus_per_node, relax gpu_model/min_gpu_memory_gb, "
        "or set allow_mixed_gpus",
    )


def _eligible(job: JobSpec, gpu: Gpu) -> bool:
    """Whether the job's model and memory-floor filters let it use ``gpu``."""
    res = job.resources
    if res.gpu_model is not None and gpu.model.lower() != res.gpu_model.lower():
        return False
    return res.min_gpu_memory_gb is None or gpu.memory_gb >= res.min_gpu_memory_gb


def _group_reasons(reasons: list[tuple[str, str]], limit: int = 6) -> list[str]:
    """Nodes refused for the same reason share one entry: ``gpu[01-16]: no A100 GPU``."""
    by_reason: dict[str, list[str]] = {}
    for name, why in reasons:
        by_reason.setdefault(why, []).append(name)
    lines = [f"{hostlist.compress(names)}: {why}" for why, names in by_reason.items()]
    if len(lines) > limit:
        return [*lines[:limit], f"... ({len(lines) - limit} more reasons)"]
    return lines


def _short_list(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")
