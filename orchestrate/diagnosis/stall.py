"""Who a stalled job waits for: the stall classifier.

Its inputs are what the per-rank sidecar (:mod:`orchestrate.diagnosis.sidecar`) writes and
:mod:`orchestrate.diagnosis.evidence` reads: heartbeats and, once a stall is declared
(:mod:`orchestrate.diagnosis.stallrule`), each rank's answer to a dump request, or ``None`` for
a rank that did not answer: a frozen rank's silence is the signal. Pure (values in, values out;
the clock is a parameter), standard library only, Python 3.8+: a launcher inside a Slurm batch
script runs it with the node's python.

:func:`classify` names the kind, the ranks and one sentence (:class:`Diagnosis`):

- ``frozen``: ranks that did not answer the dump request (a stopped process, or one hung in
  native code holding the GIL);
- ``teardown``: ranks whose program ended (their sidecar's last beat, at the exit) but whose
  process lives on, when no rank is still in its program: something freed at exit blocks them
  (a process group destroyed from C++ while a gloo thread waits for the GIL,
  pytorch/pytorch#56297);
- ``rendezvous``: ranks that never reached ``init_process_group`` while others wait at the store;
- ``laggard``: in the process group with a collective in flight, ranks whose last enqueued
  collective is behind the others' (they are elsewhere: data loading, I/O, rank-0-only work;
  a rank waiting in torch's DataLoader for a worker process is said to, with the worker that
  is in the dataset's code and where: :mod:`orchestrate.diagnosis.workers`);
- ``mismatch``: ranks at the same collective number but in a different op (or sizes);
- ``transport``: every member in the same op at the same number, none completing: the data path
  itself is stuck;
- ``user_code`` (our addition): no collective is in flight anywhere; every rank is stuck in its
  own code (a deadlocked loader, a lock, a sleep). Not a communication problem, so it gets its
  own name instead of being forced into one of the above.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrate.diagnosis.diagfiles import EXIT_PHASE, Answer, Heartbeat, pg_order
from orchestrate.diagnosis.rankview import RankView, view_rank
from orchestrate.diagnosis.stallrule import (
    BEFORE_INIT,
    IN_INIT,
    Stall,
    format_ranks,
    ranks_word,
)

#: Ranks that ended their programs and hang in their exit: the one kind the supervisor stops
#: under ``on_stall: report`` too, later (orchestrate/run/linger.py).
TEARDOWN = "teardown"
KINDS = ("frozen", TEARDOWN, "rendezvous", "laggard", "mismatch", "transport", "user_code")


# --- the classifier ------------------------------------------------------------------------


@dataclass(frozen=True)
class Diagnosis:
    """What ``status --json`` shows as "diagnosis", what a launcher prints, and what
    ``diag/diagnosis.json`` keeps."""

    kind: str  # one of KINDS
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    summary: str
    at: float
    files: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "ranks": list(self.ranks),
            "nodes": list(self.nodes),
            "summary": self.summary,
            "at": self.at,
            "files": list(self.files),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Diagnosis:
        """The inverse of :meth:`to_json`; raises KeyError, TypeError or ValueError without a
        kind, a summary and a time."""
        at = data["at"]
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not data["kind"]:
            raise ValueError(f"not a diagnosis: {dict(data)!r:.200}")
        return cls(
            kind=str(data["kind"]),
            ranks=tuple(int(r) for r in data.get("ranks") or ()),
            nodes=tuple(str(n) for n in data.get("nodes") or ()),
            summary=str(data["summary"]),
            at=float(at),
            files=tuple(str(f) for f in data.get("files") or ()),
        )


def _who(views: Sequence[RankView], *, pids: bool = False) -> str:
    """``rank 3 (node b)``, ``ranks 3-4 (nodes b, c; pids 1, 2)``."""
    ranks = [v.rank for v in views]
    nodes = list(dict.fromkeys(v.node for v in views))
    inner = ("node " if len(nodes) == 1 else "nodes ") + ", ".join(nodes)
    if pids:
        known = [str(v.pid) for v in views if v.pid is not None]
        if known:
            inner += ("; " if len(nodes) > 1 or len(known) > 1 else ", ")
            inner += ("pid " if len(known) == 1 else "pids ") + ", ".join(known)
    return f"{ranks_word(ranks)} {format_ranks(ranks)} ({inner})"


def _verb(ranks: Sequence[Any], one: str, many: str) -> str:
    return one if len(ranks) == 1 else many


def _located(view: RankView) -> str:
    text = view.where()
    if view.loader is not None:
        text += ", waiting for a DataLoader worker"
        worker = view.loader
        if worker.pid is not None:
            place = "an unknown place" if worker.frame is None else worker.frame.text()
            text += f" (worker pid {worker.pid} is in {place}"
            text += f", {worker.kernel})" if worker.kernel else ")"
        return text
    return f"{text} ({view.kernel})" if view.kernel else text


def _seconds(value: float | None) -> str:
    return "" if value is None else f" for {max(0.0, value):.0f} s"


def classify(
    heartbeats: Mapping[int, Heartbeat | None],
    dumps: Mapping[int, Answer | None] | None,
    now: float,
    nodes: Mapping[int, str],
    master: str,
    interface: str | None = None,
    *,
    stall: Stall | None = None,
    alive: Mapping[int, bool] | None = None,
) -> Diagnosis:
    """Name the kind of stall, its ranks and nodes, in one sentence.

    ``dumps`` is None when no dump was requested (classification from heartbeats only: no rank
    can then count as frozen); otherwise a rank missing from it or mapped to None did not
    answer. ``stall`` (from :class:`StallWatch`) gives launcher-clock durations; without it the
    ranks' own clocks are used.
    """
    asked = dumps is not None
    answers = dumps or {}
    ranks = sorted(set(heartbeats) | set(answers) | set(nodes))
    views = [
        view_rank(r, heartbeats.get(r), answers.get(r), nodes.get(r), asked) for r in ranks
    ]
    files = [f for r in ranks if (answer := answers.get(r)) is not None for f in answer.files]

    def done(kind: str, culprits: Sequence[RankView], summary: str) -> Diagnosis:
        return Diagnosis(
            kind,
            tuple(v.rank for v in culprits),
            tuple(dict.fromkeys(v.node for v in culprits)),
            summary,
            now,
            tuple(files),
        )

    silent = [
        v for v in views
        if asked and v.heard and not v.answered and v.phase != EXIT_PHASE
        and (alive is None or alive.get(v.rank, True))
    ]
    if silent:
        ages = [_age(v, now, stall) for v in silent]
        known = [a for a in ages if a is not None]
        when = f" {min(known):.0f} s ago" if known else ""
        what = _verb(silent, "process", "processes")
        return done(
            "frozen", silent,
            f"{_who(silent, pids=True)} stopped answering{when} ({what} stopped or hung in "
            "native code)",
        )
    stuck = _stuck_at_exit(views, alive)
    if stuck:
        return done(TEARDOWN, stuck, _teardown(stuck, views, alive, now, stall))
    never = [v for v in views if not v.heard or v.phase in BEFORE_INIT]
    waiting = [v for v in views if v.phase == IN_INIT]
    if waiting and never:
        return done(
            "rendezvous", never,
            f"{_who(never)} never reached init_process_group{_first_place(never)}; "
            f"{ranks_word(waiting)} {format_ranks(v.rank for v in waiting)} "
            f"{_verb(waiting, 'waits', 'wait')} at {master}",
        )
    if waiting and len(waiting) == len(views):
        return done(
            "rendezvous", waiting,
            f"all {len(views)} ranks wait in init_process_group at {master}: the store is "
            "unreachable from them or WORLD_SIZE does not match the ranks started",
        )
    if never and len(never) == len(views):
        return done(
            "user_code", never,
            f"no rank reached init_process_group; {_places(never)}",
        )
    return _collective_stall(views, now, stall, interface, done)


if TYPE_CHECKING:  # collections.abc.Callable[...] cannot be subscripted on Python 3.8
    _Done = Callable[[str, Sequence[RankView], str], Diagnosis]


def _stuck_at_exit(views: Sequence[RankView], alive: Mapping[int, bool] | None
                   ) -> list[RankView]:
    """The ranks whose program ended (their last beat: the exit) but whose process lives,
    when no rank is still in its program: nothing else holds the job. With no ``alive`` (the
    Slurm batch host sees no other node's processes) every rank counts as living, so the
    ranks are named only when all of them have ended their programs."""
    living = [v for v in views if alive is None or alive.get(v.rank, True)]
    if living and all(v.phase == EXIT_PHASE for v in living):
        return living
    return []


def _teardown(stuck: Sequence[RankView], views: Sequence[RankView],
              alive: Mapping[int, bool] | None, now: float, stall: Stall | None) -> str:
    """``rank 1 (node a, pid 7) ended its program 12 s ago but has not exited: ...``."""
    ages = [a for a in (_age(v, now, stall) for v in stuck) if a is not None]
    when = f" {min(ages):.0f} s ago" if ages else ""
    cause = ("the interpreter's teardown (an object freed at exit blocks it, such as a "
             "process group that a DDP model still holds: docs/hangs.md)")
    if alive is None:
        return (f"{_who(stuck)} ended {_verb(stuck, 'its program', 'their programs')}{when}, "
                f"but not every process has exited: one hangs in {cause}")
    gone = [v for v in views if v not in stuck]
    exited = (f"; {ranks_word(gone)} {format_ranks(v.rank for v in gone)} "
              f"{_verb(gone, 'has', 'have')} exited") if gone else ""
    return (f"{_who(stuck, pids=True)} ended {_verb(stuck, 'its program', 'their programs')}"
            f"{when} but {_verb(stuck, 'has', 'have')} not exited: "
            f"{_verb(stuck, 'it hangs', 'they hang')} in {cause}{exited}")


def _first_place(views: Sequence[RankView]) -> str:
    for view in views:
        if not view.heard:
            return f" (rank {view.rank} has no heartbeat: it never started Python)"
        if view.frame is not None:
            kernel = f", {view.kernel}" if view.kernel else ""
            return f" (rank {view.rank} is in {view.where()}{kernel})"
    return ""


def _places(views: Sequence[RankView]) -> str:
    """``rank 0 is in a.py:3 `f`; ranks 1-4 are in b.py:9 `g` (sleeping)``."""
    groups: dict[str, list[RankView]] = {}
    for view in views:
        groups.setdefault(_located(view), []).append(view)
    return "; ".join(
        f"{ranks_word(g)} {format_ranks(v.rank for v in g)} {_verb(g, 'is', 'are')} in {place}"
        for place, g in groups.items()
    )


def _age(view: RankView, now: float, stall: Stall | None) -> float | None:
    if stall is not None and view.rank in stall.ages:
        return stall.ages[view.rank] + max(0.0, now - stall.at)
    return None if view.t is None else max(0.0, now - view.t)


def _collective_stall(
    views: Sequence[RankView], now: float, stall: Stall | None, interface: str | None,
    done: _Done,
) -> Diagnosis:
    in_flight: dict[str, int] = {}
    for view in views:
        for pg, coll in view.collectives.items():
            if coll.in_flight:
                in_flight[pg] = in_flight.get(pg, 0) + 1
    if not in_flight:
        return _without_collectives(views, done)
    pg = sorted(in_flight, key=lambda name: (-in_flight[name], pg_order(name)))[0]
    members = [v for v in views if pg in v.collectives]
    top = max(v.collectives[pg].enqueued for v in members)
    at_top = [v for v in members if v.collectives[pg].enqueued == top
              and v.collectives[pg].in_flight]
    behind = [v for v in members if v.collectives[pg].enqueued < top]
    waited = (
        stall.idle_s + max(0.0, now - stall.at) if stall is not None else _waited(at_top, pg, now)
    )
    if behind:
        return _laggard(behind, at_top, pg, top, waited, done)
    by_op: dict[tuple[str | None, str | None], list[RankView]] = {}
    for view in at_top:
        coll = view.collectives[pg]
        by_op.setdefault((coll.op, coll.sizes), []).append(view)
    known_ops = {key for key in by_op if key[0] is not None}
    if len(known_ops) > 1:
        return _mismatch(by_op, pg, done)
    label = at_top[0].collectives[pg].label()
    for view in at_top:
        if view.collectives[pg].op is not None:
            label = view.collectives[pg].label()
            break
    scope = f"all {len(at_top)} ranks" if len(at_top) == len(views) else (
        f"ranks {format_ranks(v.rank for v in at_top)} (every member of group {pg})"
    )
    via = f" (interface {interface})" if interface else ""
    return done(
        "transport", at_top,
        f"{scope} in {label}{_seconds(waited)}: the network path is stalled{via}",
    )


def _waited(views: Sequence[RankView], pg: str, now: float) -> float | None:
    since = [float(s) for s in (v.collectives[pg].since for v in views) if s]
    return now - min(since) if since else None


def _laggard(
    behind: Sequence[RankView], at_top: Sequence[RankView], pg: str, top: int,
    waited: float | None, done: _Done,
) -> Diagnosis:
    first = behind[0]
    elsewhere = [c for name, c in first.collectives.items() if name != pg and c.in_flight]
    if elsewhere:
        place = f"in {elsewhere[0].label()} at {_located(first)}"
    else:
        place = f"in {_located(first)}"
    group = "" if pg == "0" else f" on group {pg}"
    lead = f"{_who(behind)} {_verb(behind, 'has', 'have')} not reached collective #{top}{group}"
    if len(behind) == 1:
        lead += f": it is {place}"
    else:
        lead += f": rank {first.rank} is {place}"
    label = at_top[0].collectives[pg].label() if at_top else f"collective #{top}{group}"
    for view in at_top:
        if view.collectives[pg].op is not None:
            label = view.collectives[pg].label()
            break
    others = (
        f"; {ranks_word(at_top)} {format_ranks(v.rank for v in at_top)} "
        f"{_verb(at_top, 'waits', 'wait')} in {label}{_seconds(waited)}" if at_top else ""
    )
    return done("laggard", behind, lead + others)


def _mismatch(
    by_op: Mapping[tuple[str | None, str | None], list[RankView]], pg: str, done: _Done
) -> Diagnosis:
    groups = sorted(
        (g for key, g in by_op.items() if key[0] is not None),
        key=lambda g: (len(g), -min(v.rank for v in g)),
    )
    odd, rest = groups[0], groups[1:]
    ops = {key[0] for key in by_op if key[0] is not None}
    same_op = len(ops) == 1

    def label(view: RankView) -> str:
        coll = view.collectives[pg]
        return coll.label() + (f" with sizes {coll.sizes}" if same_op and coll.sizes else "")

    parts = [
        f"{_who(odd)} {_verb(odd, 'is', 'are')} in {label(odd[0])} at {odd[0].frame.short()}"
        if odd[0].frame is not None else
        f"{_who(odd)} {_verb(odd, 'is', 'are')} in {label(odd[0])}"
    ]
    for g in rest:
        parts.append(
            f"{ranks_word(g)} {format_ranks(v.rank for v in g)} {_verb(g, 'is', 'are')} in "
            f"{label(g[0])}"
        )
    return done("mismatch", odd, "; ".join(parts))


def _without_collectives(views: Sequence[RankView], done: _Done) -> Diagnosis:
    """No collective in flight: ranks behind in steps are laggards, else all are stuck."""
    steps = [v.step for v in views if v.step is not None]
    if steps and min(steps) < max(steps):
        low = min(steps)
        behind = [v for v in views if v.step == low]
        ahead = [v for v in views if v.step is not None and v.step > low]
        return done(
            "laggard", behind,
            f"{_who(behind)} {_verb(behind, 'is', 'are')} behind at step {low} in "
            f"{_located(behind[0])}; {ranks_word(ahead)} {format_ranks(v.rank for v in ahead)} "
            f"{_verb(ahead, 'is', 'are')} at step {max(steps)}",
        )
    return done(
        "user_code", list(views), f"no rank is in a collective; {_places(views)}"
    )
