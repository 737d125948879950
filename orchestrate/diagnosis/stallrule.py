"""When is a job stuck: the stall rule, fed the ranks' heartbeats.

A job is stalled when no rank made progress (a change in phase, step, or any process group's
enqueued/completed collective count; in phases without those counts, such as ``start`` or the
trainer's ``setup``, in the innermost frame or the main thread's CPU time) for
``max(stall_s, step_factor x median step time)``, or when an alive rank's heartbeat stopped
changing for ``silent_s``. All ages are measured on the launcher's clock (when *it* saw a beat
or a change), so clock skew between nodes does not matter. A job whose ranks never wrote a
heartbeat (the sidecar is off, or the program is not Python) is never called stalled.

Pure (values in, values out; the clock is a parameter), standard library only, Python 3.8+: a
launcher inside a Slurm batch script runs it with the node's python. Who is stuck, and why, is
the classifier's question (:mod:`orchestrate.diagnosis.stall`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrate.diagnosis.diagfiles import Heartbeat

BEFORE_INIT = ("start",)  # automatic phase of a program that has not called init yet
#: Phases in which activity (the innermost frame, the main thread's CPU time) counts as progress:
#: work that is not counted in steps or collectives (importing, the trainer's setup, a
#: checkpoint, an evaluation).
FRAME_PHASES = ("start", "setup", "checkpoint", "eval")
IN_INIT = "init_process_group"


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
                f"{ranks_word(self.silent)} {format_ranks(self.silent)}: heartbeat stopped "
                f"{oldest:.0f} s ago while the process lives"
            )
        return f"no rank made progress for {self.idle_s:.0f} s (bound {self.threshold_s:.0f} s)"

    def to_json(self) -> dict[str, Any]:
        return {"reason": self.reason, "since": self.since, "idle_s": self.idle_s,
                "threshold_s": self.threshold_s, "silent": list(self.silent),
                "ages": {str(rank): age for rank, age in self.ages.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Stall:
        """The inverse of :meth:`to_json`."""
        return cls(str(data["reason"]), float(data["since"]), float(data["idle_s"]),
                   float(data["threshold_s"]), tuple(int(r) for r in data["silent"]),
                   {int(rank): float(age) for rank, age in data["ages"].items()})


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
        self._phases: dict[int, str | None] = {}
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
        self, now: float, heartbeats: Mapping[int, Heartbeat | None], alive: Mapping[int, bool],
    ) -> Stall | None:
        """Take one look; a :class:`Stall` the first time the job counts as stalled."""
        if self._last_progress is None:
            self._last_progress = now
        if self._progressed(now, heartbeats):
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

    def _progressed(self, now: float, heartbeats: Mapping[int, Heartbeat | None]) -> bool:
        """Take in one look's heartbeats; whether any rank progressed since the last."""
        progressed = False
        timed = False
        for rank in sorted(heartbeats):
            beat = heartbeats[rank]
            if beat is None:
                continue
            identity = (beat.pid, beat.beat)
            seen = self._beats.get(rank)
            if seen is None or seen[0] != identity:
                self._beats[rank] = (identity, now)
            self._phases[rank] = beat.phase
            signature = progress_signature(beat)
            if self._signatures.get(rank) != signature:
                self._signatures[rank] = signature
                progressed = True
            if not timed and beat.step is not None:
                timed = True  # the lowest rank with steps times them
                self._time_step(rank, now, beat.step)
        return progressed

    def _time_step(self, rank: int, now: float, step: int) -> None:
        last = self._steps.get(rank)
        if last is None or step < last[1]:
            self._steps[rank] = (now, step)
            return
        if step > last[1]:
            self._step_times.append((now - last[0]) / (step - last[1]))
            del self._step_times[: -self.history]
            self._steps[rank] = (now, step)
