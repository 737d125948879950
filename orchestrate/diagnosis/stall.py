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

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrate.diagnosis.diagfiles import Answer, Frame, Heartbeat, pg_order
from orchestrate.diagnosis.kernelstate import KernelState
from orchestrate.diagnosis.stacks import (
    frame_kind,
    innermost_user_frame,
    parse_stacks,
    waits_for_loader_worker,
    worker_stacks,
)
from orchestrate.diagnosis.stallrule import (
    BEFORE_INIT,
    IN_INIT,
    Stall,
    format_ranks,
    ranks_word,
)

KINDS = ("frozen", "rendezvous", "laggard", "mismatch", "transport", "user_code")


@dataclass(frozen=True)
class Collective:
    """A rank's view of one process group."""

    pg: str
    enqueued: int
    completed: int
    op: str | None = None  # of the collective in flight, when known
    sizes: str | None = None
    since: float | None = None  # rank's clock: when the in-flight collective was created

    @property
    def in_flight(self) -> bool:
        return self.enqueued > self.completed

    def label(self) -> str:
        """``all_reduce #42`` (``#42 on group 1`` outside the default group)."""
        name = self.op or "collective"
        where = "" if self.pg == "0" else f" on group {self.pg}"
        return f"{name} #{self.enqueued}{where}"


@dataclass(frozen=True)
class LoaderWait:
    """A rank waiting in torch's DataLoader for a worker process: the worker most likely owing
    the batch, when the rank's answer carried its workers' stacks (else all None)."""

    pid: int | None = None
    frame: Frame | None = None
    kernel: str | None = None


@dataclass(frozen=True)
class RankView:
    """Everything known about one rank when classifying."""

    rank: int
    node: str
    pid: int | None
    heard: bool  # any heartbeat (or answer) at all
    answered: bool | None  # dump answered; None when no dump was asked
    phase: str | None
    step: int | None
    t: float | None  # the rank's clock at its last heartbeat
    collectives: Mapping[str, Collective]
    frame: Frame | None
    kernel: str | None  # "sleeping: hrtimer_nanosleep", "on CPU", "slow I/O: read of /x", ...
    loader: LoaderWait | None = None  # waiting in torch's DataLoader for a worker

    def where(self) -> str:
        return "an unknown place" if self.frame is None else self.frame.text()


def _collectives(beat: Heartbeat | None) -> dict[str, Collective]:
    out: dict[str, Collective] = {}
    for group in (beat.pgs if beat is not None else None) or ():
        flight = group.in_flight
        op = flight if flight is not None and flight.seq == group.enqueued else None
        out[group.pg] = Collective(
            group.pg, group.enqueued, group.completed, None if op is None else op.op,
            None if op is None or op.sizes is None
            else json.dumps(op.sizes, separators=(",", ":")),
            None if op is None else op.since,
        )
    return out


def _kernel(proc: KernelState | None) -> str | None:
    """``sleeping: hrtimer_nanosleep``, ``slow I/O: read of /ckpt/x (pipe_read)``, ``on CPU``."""
    if proc is None:
        return None
    if proc.file_io():
        return f"slow I/O: {proc.io_text()}"
    words = {"S": "sleeping", "D": "in disk I/O", "R": "on CPU", "T": "stopped",
             "t": "stopped", "Z": "exited"}.get(str(proc.state))
    if words is None:
        return None
    return f"{words}: {proc.wchan}" if proc.wchan and proc.state in ("S", "D") else words


def _loader_worker(stacks: str) -> LoaderWait:
    """The worker a DataLoader most likely waits for: the first in the dataset's (user) code,
    else the first that answered."""
    workers = [w for w in worker_stacks(stacks) if w.frames]
    if not workers:
        return LoaderWait()
    chosen = next((w for w in workers if any(frame_kind(f.file, w.stdlib) == "user"
                                              for f in w.frames)), workers[0])
    return LoaderWait(chosen.pid, innermost_user_frame(chosen.frames, chosen.stdlib),
                      _kernel(chosen.kernel))


def view_rank(
    rank: int, heartbeat: Heartbeat | None, dump: Answer | None, node: str | None, asked: bool,
) -> RankView:
    """Merge a rank's heartbeat and its answer (fresher) into one view."""
    state = dump.state if dump is not None else None
    beat = state if state is not None else heartbeat
    frame = None
    loader = None
    if dump is not None and dump.stacks:
        frames, stdlib = parse_stacks(dump.stacks)
        frame = innermost_user_frame(frames, stdlib)
        if waits_for_loader_worker(frames):
            loader = _loader_worker(dump.stacks)
    if frame is None and beat is not None:
        frame = innermost_user_frame(beat.user_stack or beat.stack, beat.stdlib)
    return RankView(
        rank=rank,
        node=str(node or (beat.host if beat is not None else None) or "?"),
        pid=beat.pid if beat is not None else None,
        heard=beat is not None,
        answered=(dump is not None) if asked else None,
        phase=beat.phase if beat is not None else None,
        step=beat.step if beat is not None else None,
        t=beat.t if beat is not None else None,
        collectives=_collectives(beat),
        frame=frame,
        kernel=_kernel(state.proc) if state is not None else None,
        loader=loader,
    )


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
    files: list[str] = []
    for rank in ranks:
        answer = answers.get(rank)
        if answer is not None:
            files.extend(answer.files)

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
        if asked and v.heard and not v.answered and v.phase != "exit"
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
