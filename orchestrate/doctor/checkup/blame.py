"""Whom to name when a checkup step fails: pure rules over what the ranks reported.

When one rank dies or hangs, every other rank fails too (a closed connection, a timeout), so
"all ranks failed" says nothing. Rank 0 collects what each rank reported and names, in order:

1. ranks that never joined, with their node (:func:`locate`);
2. ranks that went *silent*: no failure report and no result within the grace period (the
   process died, froze, or its node dropped off the network);
3. ranks that failed on their own: a wrong all_reduce result, or an error outside a collective;
4. otherwise every rank that failed, with the most common error (a shared cause such as a
   firewall, a wrong interface or a version mismatch).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from orchestrate.doctor.checkup.result import CheckupFailure

#: How a rank failed: ``wrong`` (a checked result differed), ``local`` (an error outside any
#: collective: device, memory, arguments), ``collective`` (a collective raised, usually because a
#: peer went away) or ``timeout`` (a step outlived its bound).
Kind = Literal["wrong", "local", "collective", "timeout"]


@dataclass(frozen=True)
class Report:
    """One rank's own account of its failure."""

    step: str
    kind: Kind
    detail: str


@dataclass(frozen=True)
class Member:
    """A rank that joined: where it runs, and which ranks share its node."""

    rank: int
    node: str
    first_rank: int  # RANK - LOCAL_RANK: ranks are numbered node by node
    local_world_size: int


def ranks_text(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def who(ranks: Iterable[int], node_of: Mapping[int, str]) -> str:
    """``"rank 2 (node b)"`` or ``"ranks 4-7 (node c)"`` or ``"ranks 0,4 (nodes a, c)"``."""
    ordered = sorted(set(ranks))
    nodes = list(dict.fromkeys(node_of.get(r, "unknown node") for r in ordered))
    label = "rank" if len(ordered) == 1 else "ranks"
    where = ("node " if len(nodes) == 1 else "nodes ") + ", ".join(nodes)
    return f"{label} {ranks_text(ordered)} ({where})"


def locate(
    missing: Sequence[int], members: Sequence[Member], names: Sequence[str]
) -> dict[int, str]:
    """The node of each rank that never joined.

    A joined rank vouches for its whole node (ranks ``first_rank`` to ``first_rank +
    local_world_size - 1``). Ranks of a node none of whose ranks joined are placed by the
    layout when every joined node runs the same number of ranks (rank // ranks per node into
    ``names``), else named as one of the nodes nobody reported from.
    """
    node_of: dict[int, str] = {}
    for m in members:
        for r in range(m.first_rank, m.first_rank + m.local_world_size):
            node_of.setdefault(r, m.node)
    sizes = {m.local_world_size for m in members}
    unseen = [n for n in names if n not in {m.node for m in members}]
    out: dict[int, str] = {}
    for r in missing:
        if r in node_of:
            out[r] = node_of[r]
        elif len(sizes) == 1 and names and r // next(iter(sizes)) < len(names):
            out[r] = names[r // next(iter(sizes))]
        elif len(unseen) == 1:
            out[r] = unseen[0]
        elif unseen:
            out[r] = "one of " + ", ".join(unseen)
        else:
            out[r] = "unknown node"
    return out


def never_joined(
    missing: Sequence[int], node_of: Mapping[int, str], world_size: int, waited_s: float,
    master: str,
) -> CheckupFailure:
    """The failure when ranks did not reach rank 0's store in time."""
    text = (
        f"{who(missing, node_of)} never joined: {len(missing)} of {world_size} rank(s) did not "
        f"reach the master {master} within {waited_s:g} s (not started, crashed on start, or "
        "cannot connect to MASTER_ADDR:MASTER_PORT)"
    )
    return CheckupFailure(
        tier="smoke",
        step="join",
        detail=text,
        ranks=tuple(sorted(missing)),
        nodes=tuple(dict.fromkeys(node_of.get(r, "unknown node") for r in sorted(missing))),
        per_rank={r: "never joined" for r in missing},
    )


def blame(
    tier: str,
    step: str,
    reports: Mapping[int, Report],
    silent: Sequence[int],
    last_step: Mapping[int, str],
    node_of: Mapping[int, str],
) -> CheckupFailure:
    """The failure of ``step`` from each failing rank's report and the ranks that said nothing.

    ``last_step`` is the step each silent rank had entered last (when it could be read).
    """
    per_rank = {r: f"{rep.step}: {rep.detail}" for r, rep in reports.items()}
    for r in silent:
        per_rank[r] = f"silent in {last_step.get(r, 'an unknown step')}"
    where = last_step.get(silent[0], step) if silent else step
    if silent:
        culprits = sorted(silent)
        text = (
            f"{who(culprits, node_of)} stopped answering in {where} (the process died or "
            "hung, or its node dropped off the network)"
        )
        if reports:
            text += f"; {who(reports, node_of)} then failed: {_common(reports)}"
    else:
        own = {r: rep for r, rep in reports.items() if rep.kind in ("wrong", "local")}
        if own:
            culprits = sorted(own)
            where = own[culprits[0]].step
            text = f"{who(culprits, node_of)} failed in {where}: {_common(own)}"
        else:
            culprits = sorted(reports)
            if culprits:
                where = reports[culprits[0]].step
            text = f"{who(culprits, node_of)} failed in {where}: {_common(reports)}"
    return CheckupFailure(
        tier=tier,
        step=where,
        detail=text,
        ranks=tuple(culprits),
        nodes=tuple(dict.fromkeys(node_of.get(r, "unknown node") for r in culprits)),
        per_rank=per_rank,
    )


def _common(reports: Mapping[int, Report]) -> str:
    """The most frequent detail among ``reports`` (the lowest rank's on a tie)."""
    counts = Counter(rep.detail for rep in reports.values())
    best = max(counts.values())
    for r in sorted(reports):
        if counts[reports[r].detail] == best:
            return reports[r].detail
    return ""


def kind_of(exc: BaseException) -> Kind:
    """How a step failed: a checked result differed (wrong), this rank's own trouble (local:
    memory, a bug), or a collective that broke, usually because of a peer."""
    import torch

    from orchestrate.doctor.checkup.measure import CheckFailed

    if isinstance(exc, CheckFailed):
        return "wrong"
    if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError, ValueError, TypeError,
                        AttributeError, KeyError, IndexError, AssertionError)):
        return "local"
    return "collective"


_SOURCE_REF = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def one_line(exc: BaseException) -> str:
    """An error as one short line: c10d's source references and gloo's boilerplate go."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = _SOURCE_REF.sub("", text).split(" This is typically caused by")[0]
    return text if len(text) < 400 else text[:397] + "..."
