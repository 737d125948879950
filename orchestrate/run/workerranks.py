"""The worker ranks of a launcher that starts its own (``per_node``, ``torchrun``), in the job
record.

Under those launchers orchestrate starts one process per node and records it under the node's
first rank; the node's other ranks are the workers that mp.spawn or torchrun starts, which the
supervisor never holds a handle to. Their rows would stay PENDING after the job COMPLETED, and
``status`` would show a job whose ranks never ran. So they follow their node's process: RUNNING
when it starts, and when it ends COMPLETED with it, or, when it failed, FAILED for the worker
its launcher's report names (:func:`orchestrate.core.plan.workers.worker_end`) and STOPPED for
the others (the launcher stops the rest of its workers when one fails).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from orchestrate.core.plan.outcome import RankEnd
from orchestrate.core.plan.plan import Plan
from orchestrate.run.jobrecord import STOPPED, RankState
from orchestrate.run.store import Store


def node_ranks(plan: Plan, first_ranks: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """Each node process's rank (its node's first) -> every rank of its node, in order; empty
    under ``launcher: ranks``, where every rank has a process of its own."""
    if not plan.per_node:
        return {}
    node_of = {r.rank: r.node for r in plan.ranks}
    return {first: tuple(r.rank for r in plan.ranks if r.node == node_of.get(first))
            for first in first_ranks}


def started(store: Store, job_id: str, nodes: Mapping[int, tuple[int, ...]], at: float) -> None:
    """The workers of every node process are RUNNING from its start."""
    for first, ranks in nodes.items():
        for rank in ranks:
            if rank != first:
                store.update_rank(job_id, rank, state="RUNNING", started_at=at)


def ended(store: Store, job_id: str, ranks: tuple[int, ...], end: RankEnd, state: RankState,
          at: float) -> None:
    """A node process ended, recorded as ``state``: its ranks follow it. ``end`` is its end as
    the end of the worker its report names as failed (the node's own when it names none, or
    when it succeeded)."""
    for rank in ranks:
        if end.exit.ok or rank == end.rank:
            store.update_rank(job_id, rank, state=state, exit_code=end.exit.code,
                              signal=end.exit.signal, finished_at=at)
        else:
            store.update_rank(job_id, rank, state=STOPPED, finished_at=at)
