"""Which of a node's free GPUs a job gets: close together (``pack``), across NUMA nodes
(``spread``) or the first free (``any``), and why, in words for ``plan``.

Pure. On a two-socket server (GPUs 0-3 on NUMA node 0, 4-7 on node 1, every pair ``SYS`` in
``nvidia-smi topo -m``) the two GPUs of a job either share a socket or every all-reduce crosses
the socket link; the first free GPUs are often the wrong ones once another job holds GPU 3. So
``pack`` (the default) takes the GPUs from one NUMA node, the one they fill best (so that a
bigger job later still finds a whole node free), and within it from one PCIe switch or NVLink
island when one has enough. ``spread`` deals them out across NUMA nodes (for jobs that want the
memory bandwidth of both sockets more than a short path between GPUs). A node whose inventory
has no NUMA nodes (an older file: ``inventory probe`` records them) gets the first free GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: planning values need no pydantic import
    from orchestrate.core.spec.inventory import Gpu, Island, Node


@dataclass(frozen=True)
class Picked:
    """The GPUs chosen on one node, in CUDA order, and why (empty: nothing to say)."""

    gpus: tuple[Gpu, ...]
    why: str = ""


def choose(node: Node, free: list[Gpu], want: int, how: str = "pack") -> Picked:
    """``want`` of the ``free`` GPUs of ``node`` (at least that many are free), by ``how``."""
    if how == "any" or want >= len(free):
        return Picked(tuple(free[:want]), _all_why(node, free[:want], how))
    groups = _by_numa(node, free)
    if len(groups) < 2 and not node.islands:
        return Picked(tuple(free[:want]), _all_why(node, free[:want], how))
    if how == "spread":
        return _spread(node, groups, want)
    return _pack(node, groups, want)


def _by_numa(node: Node, free: list[Gpu]) -> dict[int, list[Gpu]]:
    """The free GPUs per NUMA node (-1: GPUs of no known NUMA node), in NUMA order."""
    groups: dict[int, list[Gpu]] = {}
    for gpu in free:
        numa = node.numa_of(gpu.index)
        groups.setdefault(-1 if numa is None else numa.node, []).append(gpu)
    return dict(sorted(groups.items()))


def _pack(node: Node, groups: dict[int, list[Gpu]], want: int) -> Picked:
    """From the NUMA node the GPUs fill best (an island that holds them all first), else from
    as few NUMA nodes as will do."""
    fitting = [(numa, gpus) for numa, gpus in groups.items() if numa >= 0 and len(gpus) >= want]
    if fitting:
        def score(item: tuple[int, list[Gpu]]) -> tuple[bool, int, int]:
            numa, gpus = item
            return (_island_pick(node, gpus, want) is None, len(gpus) - want, numa)

        numa, gpus = min(fitting, key=score)
        island = _island_pick(node, gpus, want)
        chosen = island[0] if island else _closest(node, gpus, want)
        cpus = next((n.cpus for n in node.numa if n.node == numa), "")
        why = f"{_indices(chosen)} on NUMA node {numa} (CPUs {cpus})"
        if island:
            why += f", {_island_words(island[1])}"
        return Picked(_sorted(chosen), why)
    chosen = []
    used = []
    for numa, gpus in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        take = gpus[: want - len(chosen)]
        chosen.extend(take)
        used.append(numa)
        if len(chosen) == want:
            break
    nodes = ", ".join(str(n) for n in sorted(used) if n >= 0)
    return Picked(_sorted(chosen), f"{_indices(chosen)} across NUMA nodes {nodes}: no NUMA "
                  f"node has {want} free GPUs")


def _spread(node: Node, groups: dict[int, list[Gpu]], want: int) -> Picked:
    """Dealt out round the NUMA nodes, most free first."""
    queues = [list(gpus) for _, gpus in sorted(groups.items(), key=lambda kv: (-len(kv[1]),
                                                                                 kv[0]))]
    chosen: list[Gpu] = []
    while len(chosen) < want:
        for queue in queues:
            if queue and len(chosen) < want:
                chosen.append(queue.pop(0))
    used = sorted({n for n, gpus in groups.items() for g in gpus if g in chosen and n >= 0})
    return Picked(_sorted(chosen), f"{_indices(chosen)} spread across NUMA nodes "
                  f"{', '.join(map(str, used))} (resources.placement: spread)")


def _island_pick(node: Node, gpus: list[Gpu], want: int) -> tuple[list[Gpu], Island] | None:
    """``want`` GPUs of ``gpus`` within one island (the fullest fit), if one holds them."""
    best: tuple[list[Gpu], Island] | None = None
    for island in node.islands:
        inside = [g for g in gpus if g.index in island.gpus]
        if len(inside) >= want and (best is None or len(inside) < len(best[0])
                                    or (island.via == "nvlink" and best[1].via != "nvlink")):
            best = (inside, island)
    return None if best is None else (best[0][:want], best[1])


def _closest(node: Node, gpus: list[Gpu], want: int) -> list[Gpu]:
    """``want`` of ``gpus`` keeping islands whole where they can be: the fullest islands
    first, then the GPUs of no island."""
    islands = sorted(([g for g in gpus if g.index in i.gpus] for i in node.islands),
                     key=lambda members: -len(members))
    chosen: list[Gpu] = []
    for members in [*islands, gpus]:
        for gpu in members:
            if gpu not in chosen and len(chosen) < want:
                chosen.append(gpu)
    return chosen


def _all_why(node: Node, gpus: list[Gpu], how: str) -> str:
    """The reason when there was nothing to choose, or choosing was not asked for."""
    if not gpus or how == "any":
        return "" if how != "any" or not gpus else (
            f"{_indices(gpus)}: the first free (resources.placement: any)")
    numas = sorted({n.node for g in gpus for n in [node.numa_of(g.index)] if n is not None})
    if len(numas) == 1:
        cpus = next(n.cpus for n in node.numa if n.node == numas[0])
        return f"{_indices(gpus)} on NUMA node {numas[0]} (CPUs {cpus})"
    if numas:
        return f"{_indices(gpus)} across NUMA nodes {', '.join(map(str, numas))}"
    return ""


def _island_words(island: Island) -> str:
    return "joined by NVLink" if island.via == "nvlink" else "under one PCIe switch"


def _sorted(gpus: list[Gpu]) -> tuple[Gpu, ...]:
    return tuple(sorted(gpus, key=lambda g: g.index))


def _indices(gpus: list[Gpu] | tuple[Gpu, ...]) -> str:
    numbers = sorted(g.index for g in gpus)
    return ("GPU " if len(numbers) == 1 else "GPUs ") + ",".join(map(str, numbers))
