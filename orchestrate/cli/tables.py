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
        mem = Table(title="memory per GPU (estimate)")
        mem.add_column("what")
        mem.add_column("GB")
        for what in ("weights", "gradients", "buckets", "optimizer", "activations"):
            mem.add_row(what, f"{getattr(plan.memory, what) / 1e9:.2f}")
        mem.add_row("total", f"{plan.memory.total / 1e9:.2f}")
        tables.append(mem)
    return tables
