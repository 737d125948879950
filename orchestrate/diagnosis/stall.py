"""When is a job stuck, and who is it waiting for: the stall rule and the stall classifier.

Pure (values in, values out; the clock is a parameter), standard library only, Python 3.8+: a
launcher inside a Slurm batch script runs it with the node's python. Its inputs are what the
per-rank sidecar (``orchestrate.diagnosis.sidecar``) writes and ``orchestrate.collect`` reads:
heartbeats (``{rank: dict | None}``) and, once a stall is declared, each rank's answer to a dump
request
(``{rank: {"state": fresh heartbeat + "proc", "stacks": faulthandler text, "files": [...]}``,
or ``None`` for a rank that did not answer: a frozen rank's silence is the signal).

The stall rule (:class:`StallWatch`): a job is stalled when no rank made progress (a change in
phase, step, or any process group's enqueued/completed collective count; in phases without
those counts, such as ``start`` or the trainer's ``setup``, in the innermost frame or the main
thread's CPU time) for
``max(stall_s, step_factor x median step time)``, or when an alive rank's heartbeat stopped
changing for ``silent_s``. All ages are measured on the launcher's clock (when *it* saw a
beat or a change), so clock skew between nodes does not matter. A job whose ranks never wrote a
heartbeat (the sidecar is off, or the program is not Python) is never called stalled.

The classifier (:func:`classify`) names the kind, the ranks and one sentence:

- ``frozen``: ranks that did not answer the dump request (a stopped process, or one hung in
  native code holding the GIL);
- ``rendezvous``: ranks that never reached ``init_process_group`` while others wait at the store;
- ``laggard``: in the process group with a collective in flight, ranks whose last enqueued
  collective is behind the others' (they are elsewhere: data loading, I/O, rank-0-only work);
- ``mismatch``: ranks at the same collective number but in a different op (or sizes);
- ``transport``: every member in the same op at the same number, none completing: the data path
  itself is stuck;
- ``user_code`` (our addition): no collective is in flight anywhere; every rank is stuck in its
  own code (a deadlocked loader, a lock, a sleep). Not a communication problem, so it gets its
  own name instead of being forced into one of the above.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

KINDS = ("frozen", "rendezvous", "laggard", "mismatch", "transport", "user_code")
BEFORE_INIT = ("start",)  # automatic phase of a program that has not called init yet
#: Phases in which activity (the innermost frame, the main thread's CPU time) counts as progress:
#: work that is not counted in steps or collectives (importing, the trainer's setup, a
#: checkpoint, an evaluation).
FRAME_PHASES = ("start", "setup", "checkpoint", "eval")
IN_INIT = "init_process_group"
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_MAIN = re.compile(r"^# main thread (0x[0-9a-fA-F]+)")
_STDLIB = re.compile(r"^# stdlib (.*)$")
_STDLIB_PATH = re.compile(r"[/\\]lib[/\\]python\d+(\.\d+)?[/\\]")
_OURS = re.compile(r"[/\\]orchestrate[/\\](\w+[/\\])*\w+\.py$")


# --- the stall rule ----------------------------------------------------------------------------



@dataclass(frozen=True)
class Stall:
    """A stall declared by :class:`StallWatch` (launcher clock)."""

    reason: str  # "no_progress" or "silent"
    since: float  # when some rank last made progress
    idle_s: float  # seconds without progress
    threshold_s: float  # the no-progress bound in force
    silent: tuple[int, ...]  # alive ranks whose heartbeat stopped
    ages: Mapping[int, float]  # seconds since each heard rank's heartbeat last changed

    @property
    def at(self) -> float:
        """When the stall was declared."""
        return self.since + self.idle_s

    def describe(self) -> str:
        """Why the launcher acted, in a few words."""
        if self.reason == "silent":
            oldest = max(self.ages.get(r, 0.0) for r in self.silent)
            return (
                f"{_ranks_word(self.silent)} {format_ranks(self.silent)}: heartbeat stopped "
                f"{oldest:.0f} s ago while the process lives"
            )
        return f"no rank made progress for {self.idle_s:.0f} s (bound {self.threshold_s:.0f} s)"


def progress_signature(heartbeat: Mapping[str, Any]) -> tuple[Any, ...]:
    """What must change for a rank to count as progressing: phase, step, collective counts,
    and in :data:`FRAME_PHASES` also activity: the innermost frame or the main thread's CPU
    time (before ``init_process_group`` there are no collectives to count, and importing torch
    on a busy node takes long, loading libtorch for seconds in one frame; a rank stuck there
    sleeps in the same frame beat after beat). In ``running`` and ``step`` activity is not
    progress: a rank spinning in its data loader must not look alive; unless there is nothing
    else (the flight recorder off, ``TORCH_FR_BUFFER_SIZE=0``, and no steps)."""
    pgs = heartbeat.get("pgs") or []
    counters = tuple(
        (str(p.get("pg")), p.get("enqueued"), p.get("completed")) for p in pgs
        if isinstance(p, Mapping)
    )
    phase = heartbeat.get("phase")
    activity: tuple[Any, ...] = ()
    no_counts = not counters and heartbeat.get("step") is None and phase != IN_INIT
    if phase in FRAME_PHASES or no_counts:
        stack = heartbeat.get("stack")
        frame = tuple(stack[0][:2]) if stack and isinstance(stack[0], Sequence) else None
        activity = (frame, heartbeat.get("main_cpu_s"))
    return (heartbeat.get("pid"), phase, heartbeat.get("step"), counters, activity)


class StallWatch:
    """Feed it heartbeats every second or so; it answers a :class:`Stall` once per stall.

    ``alive`` maps ranks to whether their process lives; a rank missing from it counts as
    alive (a Slurm batch script may only know that the step runs).
    ``stall_s``: no-progress bound (``distributed.stall_s``); once step times are known it is
    never below ``step_factor`` median step times. ``silent_s``: how long an alive rank's
    heartbeat may stay unchanged (default ``max(stall_s / 2, 10 x heartbeat_s)``: a rank busy in
    a long GIL-holding call, such as unpickling a huge checkpoint, skips beats legitimately).
    After a stall is reported, the watch is quiet until some rank progresses again.
    """

    def __init__(
        self,
        stall_s: float = 120.0,
        heartbeat_s: float = 2.5,
        *,
        step_factor: float = 5.0,
        silent_s: float | None = None,
        history: int = 32,
    ) -> None:
        self.stall_s = float(stall_s)
        self.heartbeat_s = float(heartbeat_s)
        self.step_factor = float(step_factor)
        self.silent_s = (
            float(silent_s) if silent_s is not None else max(stall_s / 2.0, 10.0 * heartbeat_s)
        )
        self.history = history
        self._beats: dict[int, tuple[Any, float]] = {}  # rank -> ((pid, beat), seen at)
        self._phases: dict[int, Any] = {}
        self._signatures: dict[int, tuple[Any, ...]] = {}
        self._steps: dict[int, tuple[float, int]] = {}  # rank -> (seen at, step)
        self._step_times: list[float] = []
        self._last_progress: float | None = None
        self._reported = False

    def step_time(self) -> float | None:
        """Median seconds per step seen so far (lowest rank reporting steps), or None."""
        return statistics.median(self._step_times) if self._step_times else None

    def threshold(self) -> float:
        """The no-progress bound now."""
        median = self.step_time()
        if median is None:
            return self.stall_s
        return max(self.stall_s, self.step_factor * median)

    def observe(
        self,
        now: float,
        heartbeats: Mapping[int, Mapping[str, Any] | None],
        alive: Mapping[int, bool],
    ) -> Stall | None:
        """Take one look; a :class:`Stall` the first time the job counts as stalled."""
        if self._last_progress is None:
            self._last_progress = now
        progressed = False
        timed = False
        for rank in sorted(heartbeats):
            beat = heartbeats[rank]
            if not beat:
                continue
            identity = (beat.get("pid"), beat.get("beat"))
            seen = self._beats.get(rank)
            if seen is None or seen[0] != identity:
                self._beats[rank] = (identity, now)
            self._phases[rank] = beat.get("phase")
            signature = progress_signature(beat)
            if self._signatures.get(rank) != signature:
                self._signatures[rank] = signature
                progressed = True
            if not timed and isinstance(beat.get("step"), int):
                timed = True  # the lowest rank with steps times them
                self._time_step(rank, now, int(beat["step"]))
        if progressed:
            self._last_progress = now
            self._reported = False
        if self._reported or not self._beats:
            return None
        ages = {rank: now - at for rank, (_, at) in self._beats.items()}
        silent = tuple(
            rank for rank in sorted(ages)
            if alive.get(rank, True) and ages[rank] >= self.silent_s
            and self._phases.get(rank) != "exit"
        )
        idle = now - self._last_progress
        threshold = self.threshold()
        if silent:
            reason = "silent"
        elif idle >= threshold and any(alive.get(rank, True) for rank in ages):
            reason = "no_progress"
        else:
            return None
        self._reported = True
        return Stall(reason, self._last_progress, idle, threshold, silent, ages)

    def _time_step(self, rank: int, now: float, step: int) -> None:
        last = self._steps.get(rank)
        if last is None or step < last[1]:
            self._steps[rank] = (now, step)
            return
        if step > last[1]:
            self._step_times.append((now - last[0]) / (step - last[1]))
            del self._step_times[: -self.history]
            self._steps[rank] = (now, step)


# --- reading what ranks wrote ------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """One Python frame: where a rank is."""

    file: str
    line: int
    function: str

    def short(self) -> str:
        """``train.py:88``."""
        return f"{os.path.basename(self.file)}:{self.line}"

    def text(self) -> str:
        """``train.py:88 `step```."""
        return f"{self.short()} `{self.function}`"


def frame_kind(path: str, stdlib: str | None = None) -> str:
    """``user`` (the program's code), ``ours`` (orchestrate's trainer) or ``library``."""
    if path.startswith("<") or path.endswith("sitecustomize.py"):
        return "library"
    if stdlib and path.startswith(stdlib.rstrip("/\\") + "/"):
        return "library"
    if "site-packages" in path or "dist-packages" in path or _STDLIB_PATH.search(path):
        return "library"
    if re.search(r"[/\\]torch[/\\]", path):
        return "library"
    if _OURS.search(path):
        return "ours"
    return "user"


def innermost_user_frame(frames: Sequence[Frame], stdlib: str | None = None) -> Frame | None:
    """The innermost frame of the user's code, else of orchestrate's, else the innermost."""
    for wanted in ("user", "ours"):
        for frame in frames:
            if frame_kind(frame.file, stdlib) == wanted:
                return frame
    return frames[0] if frames else None


def parse_stacks(text: str) -> tuple[list[Frame], str | None]:
    """The main thread's frames (innermost first) from a sidecar's stacks file (faulthandler
    format after a ``# main thread 0x...`` header), and the rank's stdlib folder. Without the
    header the first thread that is not the dumping one is taken."""
    main_id = None
    stdlib = None
    threads: list[tuple[str, bool, list[Frame]]] = []
    for line in text.splitlines():
        if line.startswith("#"):
            found = _MAIN.match(line)
            if found:
                main_id = found.group(1).lower()
            found = _STDLIB.match(line)
            if found:
                stdlib = found.group(1).strip()
            continue
        header = _THREAD.match(line)
        if header:
            threads.append((header.group(2).lower(), header.group(1) == "Current thread", []))
            continue
        frame = _FRAME.match(line)
        if frame and threads:
            threads[-1][2].append(Frame(frame.group(1), int(frame.group(2)), frame.group(3)))
    for ident, _current, frames in threads:
        if main_id is not None and int(ident, 16) == int(main_id, 16):
            return frames, stdlib
    for _ident, current, frames in threads:
        if not current:
            return frames, stdlib
    return (threads[0][2] if threads else []), stdlib


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
    kernel: str | None  # "sleeping: hrtimer_nanosleep", "on CPU", ...

    def where(self) -> str:
        return "an unknown place" if self.frame is None else self.frame.text()


def _collectives(beat: Mapping[str, Any] | None) -> dict[str, Collective]:
    out: dict[str, Collective] = {}
    for item in (beat or {}).get("pgs") or []:
        if not isinstance(item, Mapping):
            continue
        try:
            pg = str(item["pg"])
            enqueued = int(item.get("enqueued", -1))
            completed = int(item.get("completed", -1))
        except (KeyError, TypeError, ValueError):
            continue
        op = item.get("op") if item.get("op_seq") == enqueued else None
        sizes = item.get("sizes") if op is not None else None
        out[pg] = Collective(
            pg, enqueued, completed, op,
            None if sizes is None else json.dumps(sizes, separators=(",", ":")),
            item.get("op_since") if op is not None else None,
        )
    return out


def _kernel(proc: Any) -> str | None:
    if not isinstance(proc, Mapping):
        return None
    state, wchan = proc.get("state"), proc.get("wchan")
    words = {"S": "sleeping", "D": "in disk I/O", "R": "on CPU", "T": "stopped",
             "t": "stopped", "Z": "exited"}.get(str(state))
    if words is None:
        return None
    return f"{words}: {wchan}" if wchan and state in ("S", "D") else words


def _frames_of(beat: Mapping[str, Any] | None) -> list[Frame]:
    out: list[Frame] = []
    for key in ("user_stack", "stack"):
        for item in (beat or {}).get(key) or []:
            try:
                out.append(Frame(str(item[0]), int(item[1]), str(item[2])))
            except (IndexError, TypeError, ValueError):
                continue
        if out:
            break
    return out


def view_rank(
    rank: int,
    heartbeat: Mapping[str, Any] | None,
    dump: Mapping[str, Any] | None,
    node: str | None,
    asked: bool,
) -> RankView:
    """Merge a rank's heartbeat and its answer (fresher) into one view."""
    state = dump.get("state") if dump else None
    beat: Mapping[str, Any] | None = state if isinstance(state, Mapping) else heartbeat
    frame = None
    stacks = dump.get("stacks") if dump else None
    if isinstance(stacks, str) and stacks:
        frames, stdlib = parse_stacks(stacks)
        frame = innermost_user_frame(frames, stdlib)
    if frame is None and beat is not None:
        frame = innermost_user_frame(_frames_of(beat), beat.get("stdlib"))
    host = beat.get("host") if beat else None
    pid = beat.get("pid") if beat else None
    step = beat.get("step") if beat else None
    t = beat.get("t") if beat else None
    return RankView(
        rank=rank,
        node=str(node or host or "?"),
        pid=pid if isinstance(pid, int) else None,
        heard=beat is not None,
        answered=(dump is not None) if asked else None,
        phase=beat.get("phase") if beat else None,
        step=step if isinstance(step, int) else None,
        t=float(t) if isinstance(t, (int, float)) else None,
        collectives=_collectives(beat),
        frame=frame,
        kernel=_kernel(state.get("proc")) if isinstance(state, Mapping) else None,
    )


# --- the classifier ------------------------------------------------------------------------


@dataclass(frozen=True)
class Diagnosis:
    """What ``status --json`` shows as "diagnosis", and what a launcher prints."""

    kind: str
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    summary: str
    at: float
    files: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "ranks": list(self.ranks),
            "nodes": list(self.nodes),
            "summary": self.summary,
            "at": self.at,
            "files": list(self.files),
        }


def format_ranks(ranks: Iterable[int]) -> str:
    """``0-2,4``: runs of consecutive ranks as ranges."""
    values = sorted(set(ranks))
    parts: list[str] = []
    start = prev = None
    for value in [*values, None]:
        if value is not None and prev is not None and value == prev + 1:
            prev = value
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = value
    return ",".join(parts)


def _ranks_word(ranks: Sequence[object]) -> str:
    return "rank" if len(ranks) == 1 else "ranks"


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
    return f"{_ranks_word(ranks)} {format_ranks(ranks)} ({inner})"


def _verb(ranks: Sequence[Any], one: str, many: str) -> str:
    return one if len(ranks) == 1 else many


def _located(view: RankView) -> str:
    text = view.where()
    return f"{text} ({view.kernel})" if view.kernel else text


def _seconds(value: float | None) -> str:
    return "" if value is None else f" for {max(0.0, value):.0f} s"


def classify(
    heartbeats: Mapping[int, Mapping[str, Any] | None],
    dumps: Mapping[int, Mapping[str, Any] | None] | None,
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
        if answer:
            files.extend(str(f) for f in answer.get("files") or [])

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
            f"{_ranks_word(waiting)} {format_ranks(v.rank for v in waiting)} "
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
        f"{_ranks_word(g)} {format_ranks(v.rank for v in g)} {_verb(g, 'is', 'are')} in {place}"
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
    pg = sorted(in_flight, key=lambda name: (-in_flight[name], _pg_order(name)))[0]
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


def _pg_order(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)


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
        f"; {_ranks_word(at_top)} {format_ranks(v.rank for v in at_top)} "
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
            f"{_ranks_word(g)} {format_ranks(v.rank for v in g)} {_verb(g, 'is', 'are')} in "
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
            f"{_located(behind[0])}; {_ranks_word(ahead)} {format_ranks(v.rank for v in ahead)} "
            f"{_verb(ahead, 'is', 'are')} at step {max(steps)}",
        )
    return done(
        "user_code", list(views), f"no rank is in a collective; {_places(views)}"
    )


# --- the table of `orchestrate diagnose` -------------------------------------------------------


@dataclass(frozen=True)
class RankRow:
    """One line of ``orchestrate diagnose``."""

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
    extra: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "node": self.node, "pid": self.pid, "phase": self.phase,
            "step": self.step, "collectives": list(self.collectives),
            "heartbeat_age_s": self.heartbeat_age_s, "frame": self.frame,
            "answered": self.answered, "kernel": self.kernel,
        }


def rank_table(
    heartbeats: Mapping[int, Mapping[str, Any] | None],
    dumps: Mapping[int, Mapping[str, Any] | None] | None,
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
            for c in sorted(view.collectives.values(), key=lambda c: _pg_order(c.pg))
        )
        age = ages.get(rank) if ages is not None else None
        beat = heartbeats.get(rank)
        if age is None and beat and isinstance(beat.get("t"), (int, float)):
            age = max(0.0, now - float(beat["t"]))
        rows.append(RankRow(
            rank, view.node, view.pid, view.phase, view.step, colls, age,
            None if view.frame is None else view.frame.text(), view.answered, view.kernel,
        ))
    return rows


def idle_s(heartbeats: Mapping[int, Mapping[str, Any] | None]) -> float | None:
    """Seconds since the job last progressed, from heartbeats alone (each rank's own clock:
    ``t - progress_t``); for a one-shot look (``orchestrate diagnose``) without a watch."""
    idles = []
    for beat in heartbeats.values():
        if beat and isinstance(beat.get("t"), (int, float)) and isinstance(
            beat.get("progress_t"), (int, float)
        ):
            idles.append(float(beat["t"]) - float(beat["progress_t"]))
    return min(idles) if idles else None
