"""The world check: a process group that is not the plan's is named at once, never trained on.

A program that builds its own world -- the field notes' ``torch.multiprocessing.spawn`` with
``MASTER_ADDR='localhost'`` and ``world_size=torch.cuda.device_count()``, or torchrun inside a
``ranks`` job -- runs happily: every node trains a model of its own, and the job would end
COMPLETED. Every process that forms a process group records the rank and world size it joined
with (:class:`~orchestrate.diagnosis.diagfiles.Joined`, written by the rank sidecar and the join
watch); :func:`wrong_world` compares them with the plan and names the first process that is
not where the plan puts it, in one sentence, as a diagnosis of kind ``wrong_world``:

- a world of another size than the plan's (every process that formed one is named: the first
  with the world it formed, after the plan's world when it re-initialised, the others by rank);
- the same rank joined by two processes (two worlds of the plan's size, or workers numbered
  from 0 on every node);
- under ``launcher: ranks``, a rank's own process that joined as another rank than its RANK.

Pure (values in, values out), standard library only, Python 3.8+: the Slurm batch job runs it
with the node's python (``monitor.py watch``), and the SSH and local supervisors in-process.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrate.diagnosis.diagfiles import Joined
from orchestrate.diagnosis.stall import Diagnosis
from orchestrate.diagnosis.stallrule import format_ranks, ranks_word

KIND = "wrong_world"
DOCS = "see docs/launchers.md"

#: Why a world differs, by the job's launcher: what the program most likely does.
_WHY = {
    "ranks": "the program builds its own world (mp.spawn or torchrun inside a `ranks` job?)",
    "per_node": "the program's workers must join the plan's world: WORLD_SIZE, and rank "
                "ORCHESTRATE_FIRST_RANK + i (NODE_RANK * NPROC_PER_NODE + i on even nodes)",
    "torchrun": "the program builds a world of its own inside torchrun's",
}


def wrong_world(joined: Sequence[Joined], world_size: int, launcher: str, at: float
                ) -> Diagnosis | None:
    """The first process in ``joined`` (one attempt's records) whose process group is not the
    plan's world of ``world_size``, as a diagnosis; None while every one fits."""
    why = _WHY.get(launcher, _WHY["ranks"])
    ordered = sorted(joined, key=lambda j: (j.t or 0.0, j.rank or 0))
    wrong = [one for one in ordered if one.world_size != world_size]
    if wrong:
        return _wrong_size(wrong, ordered, world_size, f"{why}; {DOCS}", at)
    twice = _twice(ordered)
    if twice:
        ranks = sorted(twice)
        places = sorted({f"{_host(j)} pid {j.pid}" for r in ranks for j in twice[r]})
        hosts = tuple(sorted({_host(j) for r in ranks for j in twice[r]}))
        return Diagnosis(
            KIND, tuple(ranks), hosts,
            f"{ranks_word(ranks)} {format_ranks(ranks)} joined more than once "
            f"({', '.join(places)}): the processes formed separate worlds of the plan's size "
            f"{world_size}; {why}; {DOCS}", at)
    if launcher == "ranks":
        for one in ordered:
            if one.heartbeats and one.env_rank is not None and one.env_rank != one.rank:
                return Diagnosis(
                    KIND, (one.env_rank,), (_host(one),),
                    f"rank {one.env_rank} on {_host(one)} joined as rank {one.rank}: its "
                    f"init_process_group(rank=...) is not the RANK the plan gave it; {DOCS}", at)
    return None


def _wrong_size(wrong: Sequence[Joined], ordered: Sequence[Joined], world_size: int,
                hint: str, at: float) -> Diagnosis:
    """Every process that formed a world of another size than the plan's, the first named with
    the world it formed (after the plan's, when it re-initialised), the others by rank."""
    first = wrong[0]
    who = _who(first, ordered)
    others = sorted({_who(one, ordered) for one in wrong} - {who})
    before = _earlier(first, ordered)
    if before is not None:
        formed = (f"joined the plan's world of {world_size} as rank {before.rank}, then "
                  f"re-initialised a world of {first.world_size} as rank {first.rank}")
    else:
        formed = f"joined a world of {first.world_size}"
    sizes = sorted({one.world_size or 0 for one in wrong if _who(one, ordered) != who})
    worlds = "a world" if len(others) == 1 and len(sizes) == 1 else "worlds"
    also = (f" ({ranks_word(others)} {format_ranks(others)} formed {worlds} of "
            f"{', '.join(map(str, sizes))} too)" if others else "")
    return Diagnosis(
        KIND, (who, *others), tuple(sorted({_host(one) for one in wrong})),
        f"rank {who} on {_host(first)} {formed}, the plan has {world_size}{also}: {hint}", at)


def _who(one: Joined, ordered: Sequence[Joined]) -> int:
    """The plan's rank of a process: RANK where it has one (a rank's own workers inherit it),
    else the rank it first joined as."""
    if one.env_rank is not None:
        return one.env_rank
    before = _earlier(one, ordered)
    return (before.rank if before is not None else one.rank) or 0


def _earlier(one: Joined, ordered: Sequence[Joined]) -> Joined | None:
    """The same process's earlier join of a world of another size (before a re-init)."""
    for other in ordered:
        if other is one:
            return None
        if (other.host, other.pid) == (one.host, one.pid) and other.world_size != one.world_size:
            return other
    return None


def _twice(joined: Sequence[Joined]) -> dict[int, list[Joined]]:
    """Ranks that more than one process joined as, with those processes."""
    by_rank: dict[int, list[Joined]] = {}
    for one in joined:
        if one.rank is not None:
            by_rank.setdefault(one.rank, []).append(one)
    return {rank: found for rank, found in by_rank.items()
            if len({(j.host, j.pid) for j in found}) > 1}


def _host(one: Joined) -> str:
    return one.host or "?"
