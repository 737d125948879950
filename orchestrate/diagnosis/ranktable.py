"""The table of ``orchestrate diagnose``: one row per rank, from its heartbeat and answer.

Pure, standard library only: every rank's node, pid, phase, step, the last collective of each
process group with its state, the heartbeat's age and the innermost frame of the user's code
(:func:`orchestrate.diagnosis.rankview.view_rank`), whether or not the job is stalled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrate.diagnosis.diagfiles import Answer, Heartbeat, pg_order
from orchestrate.diagnosis.rankview import view_rank


@dataclass(frozen=True)
class RankRow:
    """One line of ``orchestrate diagnose`` (``--json``: :meth:`to_json`)."""

    rank: int
    node: str
    pid: int | None
    phase: str | None
    step: int | None
    collectives: tuple[str, ...]  # "group 0: all_reduce #42 waiting", "group 1: #7 done"
    heartbeat_age_s: float | None
    frame: str | None
    answered: bool | None
    kernel: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "node": self.node, "pid": self.pid, "phase": self.phase,
            "step": self.step, "collectives": list(self.collectives),
            "heartbeat_age_s": self.heartbeat_age_s, "frame": self.frame,
            "answered": self.answered, "kernel": self.kernel,
        }


def rank_table(
    heartbeats: Mapping[int, Heartbeat | None],
    dumps: Mapping[int, Answer | None] | None,
    now: float,
    nodes: Mapping[int, str],
    ages: Mapping[int, float] | None = None,
) -> list[RankRow]:
    """Every rank's state, for a table; ``ages`` (launcher clock) beat ``now - t``."""
    asked = dumps is not None
    answers = dumps or {}
    rows = []
    for rank in sorted(set(heartbeats) | set(answers) | set(nodes)):
        view = view_rank(rank, heartbeats.get(rank), answers.get(rank), nodes.get(rank), asked)
        colls = tuple(
            f"group {c.pg}: {c.op or 'collective'} #{c.enqueued} waiting" if c.in_flight
            else f"group {c.pg}: #{c.completed} done"
            for c in sorted(view.collectives.values(), key=lambda c: pg_order(c.pg))
        )
        age = ages.get(rank) if ages is not None else None
        beat = heartbeats.get(rank)
        if age is None and beat is not None and beat.t is not None:
            age = max(0.0, now - beat.t)
        rows.append(RankRow(
            rank, view.node, view.pid, view.phase, view.step, colls, age,
            None if view.frame is None else view.frame.text(), view.answered, view.kernel,
        ))
    return rows


def idle_s(heartbeats: Mapping[int, Heartbeat | None]) -> float | None:
    """Seconds since the job last progressed, from heartbeats alone (each rank's own clock:
    ``t - progress_t``); for a one-shot look (``orchestrate diagnose``) without a watch."""
    idles = [beat.t - beat.progress_t for beat in heartbeats.values()
             if beat is not None and beat.t is not None and beat.progress_t is not None]
    return min(idles) if idles else None
