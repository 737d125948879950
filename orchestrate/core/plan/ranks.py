"""Rank numbering: every process of the job gets its global rank, local rank and node rank.

Pure. The placement's nodes are numbered in plan order (node rank = position), and ranks are
contiguous per node from a prefix sum of the per-node counts, as torchrun's elastic agent assigns
them: 3 + 2 processes give ranks 0-2 on node 0 and 3-4 on node 1, local ranks restarting at 0 on
every node. On a GPU node local rank *i* drives the node's *i*-th chosen GPU (``cuda:i`` with the
node's chosen GPUs all visible), so the rank table can say which physical GPU each rank uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrate.core.plan.placement import Choice


@dataclass(frozen=True)
class RankPlan:
    """One process."""

    rank: int
    local_rank: int
    node: str
    node_rank: int
    gpu_index: int | None  # CUDA index (PCI bus order) of the GPU it drives, or None on CPU
    gpu_model: str | None


@dataclass(frozen=True)
class NodeRanks:
    """One node's part of the numbering."""

    choice: Choice
    node_rank: int
    first_rank: int
    ranks: tuple[RankPlan, ...]


def number_ranks(choices: tuple[Choice, ...]) -> tuple[NodeRanks, ...]:
    """Number every rank of the chosen nodes, in plan order."""
    numbered: list[NodeRanks] = []
    first = 0
    for node_rank, choice in enumerate(choices):
        ranks = tuple(
            RankPlan(
                rank=first + local,
                local_rank=local,
                node=choice.node.name,
                node_rank=node_rank,
                gpu_index=choice.gpus[local].index if choice.gpus else None,
                gpu_model=choice.gpus[local].model if choice.gpus else None,
            )
            for local in range(choice.nproc)
        )
        numbered.append(NodeRanks(choice, node_rank, first, ranks))
        first += choice.nproc
    return tuple(numbered)
