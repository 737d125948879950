"""Which rank holds the others back: per-rank figures from the trainer's step-timing windows.

Pure: values in, values out (the records of ``timing/rank-<R>.jsonl``, format in
orchestrate/train/timing.py; reading them is :func:`orchestrate.report.runfiles.read_timing`).

Under DDP the ranks leave each step's gradient all-reduce together, so the slowest rank sets the
pace and every other rank waits for it *inside its backward pass*. Per rank and per optimizer
step (totals over the windows considered, divided by the steps in them):

- ``data_s``: waiting for the next batch;
- ``forward_s``, ``backward_s``, ``optimizer_s``: as measured (``backward_s`` includes DDP's
  gradient synchronisation, which overlaps the backward pass);
- ``backward floor``: the smallest ``backward_s`` of all ranks: the rank that waited least (the
  straggler itself, usually) spent about this on its own backward pass plus the all-reduce
  transfer that every rank makes; the floor assumes the backward pass costs the same on every
  rank (same model, same batch size);
- ``sync_s`` = ``backward_s`` - floor: time spent waiting for other ranks to reach the
  all-reduce, i.e. the gap that a slower rank forces on this one (0 on the rank with the floor);
- ``compute_s`` = ``forward_s`` + floor + ``optimizer_s``: the rank's own compute;
- ``own_s`` = ``data_s`` + ``compute_s``: the rank's own work per step. ``data_s + compute_s +
  sync_s`` is the rank's measured step time (the windows' ``wall_s`` also holds logging,
  checkpoints and validation, kept apart as ``step_s``).

The straggler is the rank with the longest own work; its ``gap_pct`` is how much longer that is
than the median own work of the *other* ranks (so that with 2 ranks it is compared with the
other rank, not with a median it is half of). It is reported only when the gap is material,
``gap_pct >= MATERIAL_GAP_PCT`` (10%): below that, timing noise on a busy machine can make any
rank look slowest.
"""

from __future__ import annotations

import math
import operator
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

#: A straggler is named when its own work per step is at least this much (%) above the others'.
MATERIAL_GAP_PCT = 10.0

_BUCKETS = ("data_s", "forward_s", "backward_s", "optimizer_s")


@dataclass(frozen=True)
class RankPace:
    """One rank's figures per optimizer step (seconds) over the windows considered."""

    rank: int
    node: str
    steps: int
    samples: int
    data_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    compute_s: float
    sync_s: float
    own_s: float
    step_s: float  # window wall time per step, everything included
    steps_per_s: float
    samples_per_s: float
    gap_pct: float  # own work vs the median of the other ranks' (0 with one rank)
    last_step: int
    last_t: float  # wall-clock end of the latest window

    def to_json(self) -> dict[str, Any]:
        """The figures with times rounded to microseconds (``status --json``)."""
        return {
            key: round(value, 6) if isinstance(value, float) else value
            for key, value in asdict(self).items()
        }


@dataclass(frozen=True)
class Straggler:
    """The rank that sets the pace, and by how much (%) its own work per step exceeds the
    typical rank's."""

    rank: int
    node: str
    gap_pct: float

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "gap_pct": round(self.gap_pct, 1)}


@dataclass(frozen=True)
class Pace:
    """Every timed rank's figures (by rank) and the straggler, if the gap is material."""

    ranks: tuple[RankPace, ...]
    straggler: Straggler | None
    slowest: int | None  # the rank with the longest own work, material or not

    def by_rank(self) -> dict[int, RankPace]:
        return {r.rank: r for r in self.ranks}


_FIELDS = ("t", "steps", "samples", "last_step", *_BUCKETS, "wall_s")
_GET_FIELDS = operator.itemgetter(*_FIELDS)


def _row(window: Mapping[str, Any]) -> tuple[float, ...] | None:
    """A window's numbers in :data:`_FIELDS` order; None when one is missing or not a number
    (a damaged record is skipped, never fatal). A report reads every window of every rank
    (16,000 for 10,000 steps on 16 ranks): itemgetter and map keep this in C."""
    try:
        return tuple(map(float, _GET_FIELDS(window)))
    except (KeyError, TypeError, ValueError):
        return None


def pace(
    windows: Mapping[int, Sequence[Mapping[str, Any]]],
    nodes: Mapping[int, str],
    *,
    last_s: float | None = None,
) -> Pace:
    """Per-rank figures and the straggler from each rank's timing windows.

    ``last_s``: only the windows that ended within that many seconds of the newest window of
    any rank (a live view wants the current pace; a report the whole run). Ranks without a
    window with steps are left out.
    """
    rows = {rank: [r for w in ws if (r := _row(w)) is not None and r[1] > 0]
            for rank, ws in windows.items()}
    newest = max((r[0] for rs in rows.values() for r in rs), default=0.0)
    totals: dict[int, dict[str, float]] = {}
    for rank, rank_rows in rows.items():
        chosen = rank_rows if last_s is None else [r for r in rank_rows
                                                   if r[0] >= newest - last_s]
        if not chosen:
            continue
        columns = list(zip(*chosen, strict=True))
        sums = {key: math.fsum(columns[i]) for i, key in enumerate(_FIELDS)}
        sums["last_step"] = max(columns[3])
        sums["last_t"] = max(columns[0])
        totals[rank] = sums
    if not totals:
        return Pace((), None, None)
    per_step = {
        rank: {key: sums[key] / sums["steps"] for key in _BUCKETS} for rank, sums in totals.items()
    }
    floor = min(p["backward_s"] for p in per_step.values())
    own = {
        rank: p["data_s"] + p["forward_s"] + floor + p["optimizer_s"]
        for rank, p in per_step.items()
    }
    gaps = {rank: _gap(own, rank) for rank in own}
    figures = []
    for rank in sorted(totals):
        sums, p = totals[rank], per_step[rank]
        wall = sums["wall_s"]
        figures.append(
            RankPace(
                rank=rank,
                node=nodes.get(rank, "?"),
                steps=int(sums["steps"]),
                samples=int(sums["samples"]),
                data_s=p["data_s"],
                forward_s=p["forward_s"],
                backward_s=p["backward_s"],
                optimizer_s=p["optimizer_s"],
                compute_s=p["forward_s"] + floor + p["optimizer_s"],
                sync_s=p["backward_s"] - floor,
                own_s=own[rank],
                step_s=wall / sums["steps"],
                steps_per_s=sums["steps"] / wall if wall > 0 else 0.0,
                samples_per_s=sums["samples"] / wall if wall > 0 else 0.0,
                gap_pct=gaps[rank],
                last_step=int(sums["last_step"]),
                last_t=sums["last_t"],
            )
        )
    slowest = max(own, key=lambda rank: (own[rank], -rank)) if len(own) > 1 else None
    straggler = None
    if slowest is not None and gaps[slowest] >= MATERIAL_GAP_PCT:
        straggler = Straggler(slowest, nodes.get(slowest, "?"), gaps[slowest])
    return Pace(tuple(figures), straggler, slowest)


def _gap(own: Mapping[int, float], rank: int) -> float:
    others = [value for other, value in own.items() if other != rank]
    if not others:
        return 0.0
    typical = statistics.median(others)
    return (own[rank] - typical) / typical * 100.0 if typical > 0 else 0.0


class PacePoint(NamedTuple):
    """One window of one rank, for charts: when it ended, its last step, and per step. (A
    named tuple: a report builds one per window, 16,000 for a long 16-rank run.)"""

    t: float
    step: int
    data_s: float
    forward_s: float
    backward_s: float  # holds the sync wait
    optimizer_s: float
    step_s: float
    samples_per_s: float

    @property
    def outside_backward_s(self) -> float:
        """Data + forward + optimizer: the rank's own work that no wait for others hides in
        (the backward pass is left out because it holds the sync wait)."""
        return self.data_s + self.forward_s + self.optimizer_s


def series(windows: Sequence[Mapping[str, Any]]) -> list[PacePoint]:
    """A rank's windows as points over time (windows without steps, or damaged, are skipped)."""
    points = []
    for w in windows:
        row = _row(w)
        if row is None:
            continue
        t, steps, samples, last_step, data, forward, backward, optimizer, wall = row
        if steps <= 0:
            continue
        points.append(PacePoint(
            t=t, step=int(last_step), data_s=data / steps, forward_s=forward / steps,
            backward_s=backward / steps, optimizer_s=optimizer / steps, step_s=wall / steps,
            samples_per_s=samples / wall if wall > 0 else 0.0))
    return points
