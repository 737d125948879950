"""What the bandwidth tier measures when, and how often.

Pairs: every pair of nodes once, each node in one pair at a time. A point-to-point test between
two nodes must not share a NIC with another test, or a healthy node would look slow while it
serves two partners. The circle method of round-robin tournaments gives k - 1 rounds for an even
number k of nodes (k rounds for odd k, one node resting each round), each a set of disjoint
pairs, together covering all k (k - 1) / 2 pairs.

Iterations: as many timed repetitions as fit a time budget, decided from the first (warm-up)
operation, within ``[min_iters, iters]`` (:func:`plan_iters`). Every rank must run the same
number of collectives, so the rank program first agrees on the slowest rank's first time.

Pure; used by the rank program and tested on its own.
"""

from __future__ import annotations


def pair_rounds(count: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs ``(i, j)`` with ``i < j`` over nodes ``0..count-1``."""
    if count < 2:
        return []
    players: list[int | None] = list(range(count))
    if count % 2:
        players.append(None)  # the node paired with None rests that round
    size = len(players)
    rounds: list[list[tuple[int, int]]] = []
    for _ in range(size - 1):
        pairs: list[tuple[int, int]] = []
        for k in range(size // 2):
            a, b = players[k], players[size - 1 - k]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        # Keep the first player fixed and rotate the others by one.
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


def plan_iters(
    first_s: float, warmup: int, iters: int, min_iters: int, budget_s: float
) -> tuple[int, int]:
    """(further warm-up operations, timed operations) after a first operation of ``first_s``.

    ``budget_s <= 0`` means no budget: exactly ``warmup`` and ``iters`` (what a benchmark
    wants). Otherwise the timed operations fill ``budget_s`` and the warm-up a quarter of it.
    """
    extra_warmup = max(0, warmup - 1)
    if budget_s <= 0 or first_s <= 0:
        return extra_warmup, max(1, iters)
    fit = int(budget_s / first_s)
    timed = max(min_iters, min(iters, fit))
    warm = min(extra_warmup, int(0.25 * budget_s / first_s))
    return max(0, warm), max(1, timed)
