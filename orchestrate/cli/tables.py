"""Rich tables for people; ``--json`` is for scripts.

rich is imported when a table is drawn, not when the CLI starts: ``--json`` output, scripts and
the fast commands never pay for it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the CLI's start does not import the planner for a table
    from rich.console import Console
    from rich.table import Table

    from orchestrate.core.plan.plan import Plan
    from orchestrate.core.spec.inventory import Inventory, Node


def console(stderr: bool = False) -> Console:
    """A console that does not wrap or colour output going to a pipe."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, highlight=False, width=None if stream.isatty() else 200)


def _gpu_summary(node: Node) -> str:
    if not node.gpus:
        return f"CPU x{node.slots}"
    parts = []
    for model in node.models():
        indices = [g.index for g in node.gpus if g.model == model]
        memory = next(g.memory_gb for g in node.gpus if g.model == model)
        parts.append(f"{len(indices)}x {model} {memory:g}GB [{','.join(map(str, indices))}]")
    return "; ".join(parts)


def inventory_table(inv: Inventory) -> Table:
    """One row per node: address, GPUs by model with CUDA (PCI bus order) indices, links."""
    from rich.table import Table

    table = Table(title=f"inventory {inv.name}: {len(inv.nodes)} node(s)")
    for column in ("node", "address", "GPUs (CUDA index = nvidia-smi index, PCI bus order)",
                   "link", "network", "partition"):
        table.add_column(column)
    for node in inv.nodes:
        net = node.network
        network = "-" if net is None else " ".join(
            x for x in (net.fabric, net.interface or "", f"{net.gbps:g}Gb/s" if net.gbps else "",
                        net.hca or "") if x
        )
        table.add_row(node.name, node.address, _gpu_summary(node), node.gpu_link, network,
                      node.partition or "-")
    return table


def plan_tables(plan: Plan) -> list[Table]:
    """The node table, the rank table and the common environment."""
    from rich.table import Table

    head = (
        f"job {plan.job_id} via {plan.backend}: world_size {plan.world_size}, "
        f"{plan.dist_backend}, master {plan.master_addr}:{plan.master_port}"
    )
    nodes = Table(title=head)
    contained = any(n.container is not None for n in plan.nodes)
    for column in ("node_rank", "node", "address", "nproc", "ranks", "CUDA_VISIBLE_DEVICES",
                   "GPU models", *(("container",) if contained else ())):
        nodes.add_column(column)
    for n in plan.nodes:
        # A container: its runtime and image (docs/containers.md), per node.
        box = () if not contained else (
            f"{n.container.runtime} {n.container.image}" if n.container else "-",)
        nodes.add_row(str(n.node_rank), n.name, n.address, str(n.nproc),
                      f"{n.first_rank}-{n.last_rank}", n.cuda_visible_devices or "-",
                      ", ".join(dict.fromkeys(n.gpu_models)) or "CPU", *box)
    ranks = Table(title="ranks")
    for column in ("RANK", "LOCAL_RANK", "node", "GROUP_RANK", "device"):
        ranks.add_column(column)
    for r in plan.ranks:
        device = (
            "cpu"
            if r.gpu_index is None
            else f"cuda:{r.local_rank} = GPU {r.gpu_index} ({r.gpu_model})"
        )
        ranks.add_row(str(r.rank), str(r.local_rank), r.node, str(r.node_rank), device)
    env = Table(title="environment (every rank; per-node values in the node table and scripts)")
    env.add_column("variable")
    env.add_column("value")
    for key, value in plan.env.items():
        env.add_row(key, value)
    if len(plan.nodes) == 1:
        for key, value in plan.nodes[0].env.items():
            env.add_row(key, value)
    tables = [nodes, ranks, env]
    if plan.memory is not None:
        tables.append(memory_table(plan))
    if plan.batch is not None:
        tables.append(shares_table(plan))
    return tables


def decision_line(plan: Plan) -> str | None:
    """The layout the plan runs and why, one sentence (None for a command job)."""
    memory = plan.memory
    if memory is None:
        return None
    chosen = [e for e in memory.estimates if e.strategy == memory.layout]
    method = chosen[0].method if chosen else "formula"
    refused = sorted({e.strategy for e in memory.estimates
                      if e.strategy != memory.layout and e.fits is False})
    why = f" ({', '.join(refused)} does not fit)" if refused else ""
    how = "traced (a step on fake tensors)" if method == "traced" else (
        "from the formula, a lower bound: its activations are train.activation_memory_gb's "
        "allowance, not this model's at this batch and sequence length")
    line = f"strategy: {memory.layout}{why}; memory per rank {how}"
    if chosen:
        from orchestrate.core.plan.memory import biggest_part

        worst = max(chosen, key=lambda e: e.peak_gb)
        name, size = biggest_part(worst.parts)
        line += f"; the biggest part of its peak: {name}, {size:.1f} GB of {worst.peak_gb:.1f}"
    return line


def memory_table(plan: Plan) -> Table:
    """Each layout the planner weighed, per GPU model: the worst rank's estimated peak against
    the GPU's memory (or a CPU rank's share of its node's), and how it was estimated."""
    from rich.table import Table

    assert plan.memory is not None
    table = Table(title=f"memory per rank (estimate; the plan runs {plan.memory.layout})",
                  caption="GB: 10^9 bytes; a GPU's capacity is the inventory's memory_gb, "
                          "which is GiB (nvidia-smi's MiB / 1024): 48 GiB = 51.5 GB")
    for column in ("strategy", "GPU model", "peak GB", "capacity GB", "fits", "method",
                   "weights / grads / optimizer / working set / activations / autocast "
                   "cache / overhead GB"):
        table.add_column(column)
    for e in plan.memory.estimates:
        parts = e.parts
        working = parts.get("buckets", 0.0) + parts.get("gathered", 0.0)
        split = " / ".join(f"{v:.2f}" for v in (
            parts.get("weights", 0.0), parts.get("gradients", 0.0), parts.get("optimizer", 0.0),
            working, parts.get("activations", 0.0), parts.get("autocast", 0.0),
            parts.get("overhead", 0.0)))
        mark = "yes" if e.fits else "no" if e.fits is False else "?"
        table.add_row(e.strategy + (" *" if e.strategy == plan.memory.layout else ""),
                      e.gpu_model, f"{e.peak_gb:.2f}",
                      "-" if e.capacity_gb is None else f"{e.capacity_gb:.1f}", mark, e.method,
                      split)
    return table


def shares_table(plan: Plan) -> Table:
    """Each rank's share of the global batch, its memory cap and its estimated peak."""
    from rich.table import Table

    assert plan.batch is not None
    split = plan.batch
    table = Table(title=f"batch shares: global batch {split.global_batch_size}, split "
                        f"{split.split}", caption=(
                            "the shares to start from: the ranks' measured time per sample "
                            "sets them after the first steps, within each memory cap"
                            if split.split == "measured" else None))
    for column in ("RANK", "device", "speed", "share", "memory cap", "peak GB", "fits"):
        table.add_column(column)
    memory = {r.rank: r for r in plan.memory.ranks} if plan.memory is not None else {}
    for r in plan.ranks:
        m = memory.get(r.rank)
        speed = split.speeds[r.rank] if r.rank < len(split.speeds) else 1.0
        cap = split.caps[r.rank] if r.rank < len(split.caps) else None
        table.add_row(str(r.rank), r.gpu_model or "cpu", f"{speed:g}",
                      str(split.shares[r.rank]), "-" if cap is None else str(cap),
                      "-" if m is None else f"{m.peak_gb:.2f}",
                      "-" if m is None or m.fits is None else ("yes" if m.fits else "no"))
    return table
