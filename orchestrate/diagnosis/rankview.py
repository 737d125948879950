"""What is known about one rank when a stall is classified: its collectives, where its main
thread is, what the kernel says of it, and the DataLoader worker it waits for.

A view merges the rank's last heartbeat with its answer to a dump request (fresher), both
written by its sidecar (:mod:`orchestrate.diagnosis.sidecar`). :mod:`orchestrate.diagnosis.stall`
classifies views; :mod:`orchestrate.diagnosis.ranktable` shows them a row each. Pure, standard
library only, Python 3.8+: a Slurm batch host and every SSH host run it with their own python.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from orchestrate.diagnosis.diagfiles import EXIT_PHASE, Answer, Frame, Heartbeat
from orchestrate.diagnosis.kernelstate import KernelState
from orchestrate.diagnosis.stacks import (
    frame_kind,
    innermost_user_frame,
    parse_stacks,
    waits_for_loader_worker,
    worker_stacks,
)


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
        if self.phase == EXIT_PHASE:
            return "its exit (its program had ended)"
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
    if frame is None and beat is not None and beat.phase != EXIT_PHASE:
        # (a rank's last beat, at its exit, shows the sidecar's own handler: no place of the
        # program's)
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
