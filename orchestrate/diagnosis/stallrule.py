"""When is a job stuck: the stall rule, fed the ranks' heartbeats.

A job is stalled when no rank made progress (a change in phase, step, or any process group's
enqueued/completed collective count; in phases without those counts, such as ``start`` or the
trainer's ``setup``, in the innermost frame or the main thread's CPU time) for
``max(stall_s, step_factor x median step time)`` while no rank was *busy* either, or when an
alive rank's heartbeat stopped changing for ``silent_s``.

A rank is busy (:func:`activity`) when its sidecar still beats and it is in the trainer's
``checkpoint`` or ``eval`` phase, or its main thread is blocked in file I/O (``D`` state, or
sleeping in a file system call on a file: :meth:`KernelState.file_io`), or it computes: its main
thread used at least :data:`BUSY_CPU` of a core between two beats while none of its collectives
was in flight (a rank waiting in a collective may spin on a GPU; it is not working). Busy ranks
hold the stall off up to a separate, longer bound, ``busy_s`` (``distributed.busy_s``): a long
checkpoint to slow storage, a validation pass reading slow data, one long CPU step, or rank 0
computing alone while the others wait, are not stalls; busy for longer than ``busy_s`` without
progress, they are. While it holds a stall off the watch says so once (:class:`Hold`).

All ages are measured on the launcher's clock (when *it* saw a beat or a change), so clock skew
between nodes does not matter. A job whose ranks never wrote a heartbeat (the sidecar is off, or
the program is not Python) is never called stalled.

Pure (values in, values out; the clock is a parameter), standard library only, Python 3.8+: a
launcher inside a Slurm batch script runs it with the node's python. Who is stuck, and why, is
the classifier's question (:mod:`orchestrate.diagnosis.stall`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrate.diagnosis.diagfiles import EXIT_PHASE, Heartbeat

BEFORE_INIT = ("start",)  # automatic phase of a program that has not called init yet
#: Phases in which activity (the innermost frame, the main thread's CPU time) counts as progress:
#: work that is not counted in steps or collectives (importing, the trainer's setup, a
#: checkpoint, an evaluation).
FRAME_PHASES = ("start", "setup", "checkpoint", "eval")
#: The trainer's phases in which a rank whose sidecar beats is busy, even when it shows no
#: activity (rank 0 writing to slow storage; a validation pass reading slow data).
SLOW_PHASES = ("checkpoint", "eval")
IN_INIT = "init_process_group"
#: The least share of one core the main thread must want (use, or wait for) between two beats
#: to be computing.
BUSY_CPU = 0.2
#: ``distributed.busy_s`` unless the job says: how long busy ranks may go without progress.
DEFAULT_BUSY_S = 1800.0


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


def ranks_word(ranks: Sequence[object]) -> str:
    """``rank`` or ``ranks``."""
    return "rank" if len(ranks) == 1 else "ranks"


def _busy_text(busy: Mapping[int, str]) -> str:
    """``rank 0 in slow I/O; ranks 1-2 computing``."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(busy):
        groups.setdefault(busy[rank], []).append(rank)
    return "; ".join(f"{ranks_word(r)} {format_ranks(r)} {what}" for what, r in groups.items())


@dataclass(frozen=True)
class Stall:
    """A stall declared by :class:`StallWatch` (launcher clock)."""

    reason: str  # "no_progress", "busy" (busy past busy_s without progress) or "silent"
    since: float  # when some rank last made progress
    idle_s: float  # seconds without progress
    threshold_s: float  # the bound in force (busy_s for "busy")
    silent: tuple[int, ...]  # alive ranks whose heartbeat stopped
    ages: Mapping[int, float]  # seconds since each heard rank's heartbeat last changed
    busy: Mapping[int, str] = field(default_factory=dict)  # rank -> its activity (activity())

    @property
    def at(self) -> float:
        """When the stall was declared."""
        return self.since + self.idle_s

    def describe(self) -> str:
        """Why the launcher acted, in a few words."""
        if self.reason == "silent":
            oldest = max(self.ages.get(r, 0.0) for r in self.silent)
            return (
                f"{ranks_word(self.silent)} {format_ranks(self.silent)}: heartbeat stopped "
                f"{oldest:.0f} s ago while the process lives"
            )
        if self.reason == "busy":
            return (f"no rank made progress for {self.idle_s:.0f} s, busy longer than "
                    f"distributed.busy_s ({self.threshold_s:.0f} s): {_busy_text(self.busy)}")
        return f"no rank made progress for {self.idle_s:.0f} s (bound {self.threshold_s:.0f} s)"

    def to_json(self) -> dict[str, Any]:
        return {"reason": self.reason, "since": self.since, "idle_s": self.idle_s,
                "threshold_s": self.threshold_s, "silent": list(self.silent),
                "ages": {str(rank): age for rank, age in self.ages.items()},
                "busy": {str(rank): what for rank, what in self.busy.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Stall:
        """The inverse of :meth:`to_json`."""
        return cls(str(data["reason"]), float(data["since"]), float(data["idle_s"]),
                   float(data["threshold_s"]), tuple(int(r) for r in data["silent"]),
                   {int(rank): float(age) for rank, age in data["ages"].items()},
                   {int(rank): str(what) for rank, what in (data.get("busy") or {}).items()})


@dataclass(frozen=True)
class Hold:
    """No rank progressed for the stall bound, but busy ranks hold the stall off (said once
    per such stretch: :meth:`StallWatch.take_hold`)."""

    since: float  # when some rank last made progress (launcher clock)
    idle_s: float
    threshold_s: float  # the stall bound that passed
    busy_s: float  # the bound busy ranks have
    busy: Mapping[int, str]  # rank -> its activity

    def describe(self) -> str:
        return (f"no progress for {self.idle_s:.0f} s, but not stalled: "
                f"{_busy_text(self.busy)} (a stall only after distributed.busy_s, "
                f"{self.busy_s:.0f} s)")


def _in_flight(beat: Heartbeat) -> bool:
    return any(g.enqueued > g.completed for g in beat.pgs or ())


def _wanted(beat: Heartbeat, with_wait: bool) -> float | None:
    """The main thread's CPU seconds, plus its seconds waiting for a CPU when ``with_wait``
    (both beats compared carry them)."""
    if beat.main_cpu_s is None:
        return None
    return beat.main_cpu_s + ((beat.main_wait_s or 0.0) if with_wait else 0.0)


def activity(beat: Heartbeat, previous: Heartbeat | None = None,
             elapsed_s: float | None = None) -> str | None:
    """What keeps a rank busy without progress, from a fresh beat (and the one before it from
    the same process, ``elapsed_s`` apart when the beats carry no clock): ``"in slow I/O"``
    (its main thread blocked in file I/O), ``"computing"`` (it used or waited for at least
    :data:`BUSY_CPU` of a core since the previous beat, no collective of its own in flight),
    ``"in checkpoint"`` / ``"in eval"`` (the trainer's slow phases); None when it waits, or
    nothing says."""
    if beat.phase in (IN_INIT, EXIT_PHASE, "finished"):
        return None
    if beat.proc is not None and beat.proc.file_io():
        return "in slow I/O"
    if previous is not None and previous.pid == beat.pid and not _in_flight(beat):
        both = beat.main_wait_s is not None and previous.main_wait_s is not None
        cpu, before = _wanted(beat, both), _wanted(previous, both)
        span = elapsed_s
        if beat.t is not None and previous.t is not None:
            span = beat.t - previous.t
        if cpu is not None and before is not None and span and span > 0 \
                and (cpu - before) / span >= BUSY_CPU:
            return "computing"
    if beat.phase in SLOW_PHASES:
        return f"in {beat.phase}"
    return None


def progress_signature(heartbeat: Heartbeat) -> tuple[Any, ...]:
    """What must change for a rank to count as progressing: phase, step, collective counts,
    and in :data:`FRAME_PHASES` also activity: the innermost frame or the main thread's CPU
    time (before ``init_process_group`` there are no collectives to count, and importing torch
    on a busy node takes long, loading libtorch for seconds in one frame; a rank stuck there
    sleeps in the same frame beat after beat). In ``running`` and ``step`` activity is not
    progress: a rank spinning in its data loader must not look alive; unless there is nothing
    else (the flight recorder off, ``TORCH_FR_BUFFER_SIZE=0``, and no steps)."""
    counters = tuple((g.pg, g.enqueued, g.completed) for g in heartbeat.pgs or ())
    phase = heartbeat.phase
    activity: tuple[Any, ...] = ()
    no_counts = not counters and heartbeat.step is None and phase != IN_INIT
    if phase in FRAME_PHASES or no_counts:
        stack = heartbeat.stack
        frame = (stack[0].file, stack[0].line) if stack else None
        activity = (frame, heartbeat.main_cpu_s)
    return (heartbeat.pid, phase, heartbeat.step, counters, activity)


class StallWatch:
    """Feed it heartbeats every second or so; it answers a :class:`Stall` once per stall.

    ``alive`` maps ranks to whether their process lives; a rank missing from it counts as
    alive (a Slurm batch script may only know that the step runs).
    ``stall_s``: no-progress bound (``distributed.stall_s``); once step times are known it is
    never below ``step_factor`` median step times. ``busy_s``: how long busy ranks
    (:func:`activity`) hold a stall off (``distributed.busy_s``; never below the stall bound).
    ``silent_s``: how long an alive rank's heartbeat may stay unchanged (default
    ``max(stall_s / 2, 10 x heartbeat_s)``: a rank busy in a long GIL-holding call, such as
    unpickling a huge checkpoint, skips beats legitimately). After a stall is reported, the
    watch is quiet until some rank progresses again.
    """

    def __init__(
        self,
        stall_s: float = 120.0,
        heartbeat_s: float = 2.5,
        *,
        busy_s: float | None = None,
        step_factor: float = 5.0,
        silent_s: float | None = None,
        history: int = 32,
    ) -> None:
        self.stall_s = float(stall_s)
        self.heartbeat_s = float(heartbeat_s)
        self.busy_s = float(busy_s) if busy_s is not None else max(DEFAULT_BUSY_S, stall_s)
        self.step_factor = float(step_factor)
        self.silent_s = (
            float(silent_s) if silent_s is not None else max(stall_s / 2.0, 10.0 * heartbeat_s)
        )
        self.history = history
        self._beats: dict[int, tuple[Any, float]] = {}  # rank -> ((pid, beat), seen at)
        self._last_beat: dict[int, Heartbeat] = {}  # the beat before, for CPU time
        self._phases: dict[int, str | None] = {}
        self._signatures: dict[int, tuple[Any, ...]] = {}
        self._steps: dict[int, tuple[float, int]] = {}  # rank -> (seen at, step)
        self._step_times: list[float] = []
        self._last_progress: float | None = None
        self._last_active = 0.0  # last progress, or last look that found a rank busy
        self._busy: dict[int, str] = {}  # rank -> its activity, as of its latest fresh beat
        self._busy_at: dict[int, tuple[str, float]] = {}  # rank -> its last activity, when
        self._reported = False
        self._held = False  # this stretch without progress was said to be held off
        self._hold: Hold | None = None

    def step_time(self) -> float | None:
        """Median seconds per step seen so far (lowest rank reporting steps), or None."""
        return statistics.median(self._step_times) if self._step_times else None

    def threshold(self) -> float:
        """The no-progress bound now."""
        median = self.step_time()
        if median is None:
            return self.stall_s
        return max(self.stall_s, self.step_factor * median)

    def busy_bound(self) -> float:
        """How long busy ranks may go without progress now."""
        return max(self.busy_s, self.threshold())

    def take_hold(self) -> Hold | None:
        """The :class:`Hold` the last look started, once (None otherwise)."""
        hold, self._hold = self._hold, None
        return hold

    def observe(
        self, now: float, heartbeats: Mapping[int, Heartbeat | None], alive: Mapping[int, bool],
    ) -> Stall | None:
        """Take one look; a :class:`Stall` the first time the job counts as stalled."""
        if self._last_progress is None:
            self._last_progress = self._last_active = now
        progressed, busy = self._take(now, heartbeats)
        if progressed:
            self._last_progress = self._last_active = now
            self._reported = self._held = False
        elif busy:
            self._last_active = now
        if self._reported or not self._beats:
            return None
        ages = {rank: now - at for rank, (_, at) in self._beats.items()}
        silent = tuple(
            rank for rank in sorted(ages)
            if alive.get(rank, True) and ages[rank] >= self.silent_s
            and self._phases.get(rank) != EXIT_PHASE
        )
        idle = now - self._last_progress
        threshold = self.threshold()
        living = any(alive.get(rank, True) for rank in ages)
        if silent:
            reason = "silent"
        elif now - self._last_active >= threshold and living:
            reason = "no_progress"
        elif idle >= self.busy_bound() and living:
            reason, threshold = "busy", self.busy_bound()
        else:
            if idle >= threshold and living and not self._held:
                self._held = True
                # The ranks that kept the job active within the bound, even if their latest
                # beat was idle (the hold used to name nobody then).
                recent = {rank: what for rank, (what, at) in self._busy_at.items()
                          if now - at < threshold}
                self._hold = Hold(self._last_progress, idle, threshold, self.busy_bound(),
                                  {**recent, **self._busy})
            return None
        self._reported = True
        return Stall(reason, self._last_progress, idle, threshold, silent, ages,
                     dict(self._busy) if reason == "busy" else {})

    def _take(self, now: float, heartbeats: Mapping[int, Heartbeat | None]
              ) -> tuple[bool, bool]:
        """Take in one look's heartbeats: whether any rank progressed since the last, and
        whether a fresh beat showed a busy rank (a stopped sidecar proves nothing)."""
        progressed = False
        timed = False
        busy = False
        for rank in sorted(heartbeats):
            beat = heartbeats[rank]
            if beat is None:
                continue
            identity = (beat.pid, beat.beat)
            seen = self._beats.get(rank)
            if seen is None or seen[0] != identity:
                what = activity(beat, self._last_beat.get(rank),
                                None if seen is None else now - seen[1])
                if what is not None:
                    self._busy[rank] = what
                    self._busy_at[rank] = (what, now)
                    busy = True
                else:
                    self._busy.pop(rank, None)
                self._beats[rank] = (identity, now)
                self._last_beat[rank] = beat
            self._phases[rank] = beat.phase
            signature = progress_signature(beat)
            if self._signatures.get(rank) != signature:
                self._signatures[rank] = signature
                progressed = True
            if not timed and beat.step is not None:
                timed = True  # the lowest rank with steps times them
                self._time_step(rank, now, beat.step)
        return progressed, busy

    def _time_step(self, rank: int, now: float, step: int) -> None:
        last = self._steps.get(rank)
        if last is None or step < last[1]:
            self._steps[rank] = (now, step)
            return
        if step > last[1]:
            self._step_times.append((now - last[0]) / (step - last[1]))
            del self._step_times[: -self.history]
            self._steps[rank] = (now, step)
