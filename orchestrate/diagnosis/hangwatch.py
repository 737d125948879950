"""The stall watch of a running attempt, the same on every backend: look, decide, collect, name.

Every few seconds the watch reads each rank's heartbeat (written by the rank sidecar,
``orchestrate.diagnosis.sidecar``) and feeds the stall rule
(:class:`orchestrate.diagnosis.stallrule.StallWatch`). When the job counts as stalled it asks
every rank for its stacks and flight recorder, classifies
(:func:`orchestrate.diagnosis.stall.classify`) and keeps the diagnosis in the run directory
(``diag/diagnosis.json``), so ``status``, ``diagnose`` and the report show it. When busy ranks
hold a stall off (a long checkpoint, slow I/O, a long CPU step: the rule's ``busy_s``) it says so
once, through ``notify``, naming each busy rank and where it is.

Where the evidence lies differs by backend, and only that: a local job's and a Slurm job's run
directory is the one the watch reads (Slurm's is on a shared file system, and the watch runs
inside the batch job: ``monitor.py watch``); an SSH job's ranks write on their own hosts, so
the supervisor's :class:`Evidence` fetches heartbeats and dumps over its connections and
mirrors them into the controller's run directory. Everything after that is this module.

Standard library only, Python 3.8+ (the Slurm batch job runs it with the node's python).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from orchestrate.diagnosis.diagfiles import Heartbeat, Joined
from orchestrate.diagnosis.evidence import (
    DEFAULT_COLLECT_S,
    Collection,
    collect,
    read_heartbeats,
    read_joined,
    write_diagnosis,
)
from orchestrate.diagnosis.stacks import innermost_user_frame
from orchestrate.diagnosis.stall import Diagnosis, classify
from orchestrate.diagnosis.stallrule import Hold, Stall, StallWatch
from orchestrate.diagnosis.world import wrong_world


class Evidence(Protocol):
    """Where a watch reads the ranks' heartbeats and gets their dumps."""

    def heartbeats(self) -> dict[int, Heartbeat | None]:
        """Each rank's latest heartbeat (None: none yet)."""

    def collect(self, timeout_s: float) -> Collection:
        """Ask every rank for a dump and wait up to ``timeout_s``
        (:func:`orchestrate.diagnosis.evidence.collect`), its files in the controller's run
        directory."""

    def joined(self) -> list[Joined]:
        """The attempt's processes that formed a process group, as far as known at the last
        :meth:`heartbeats`."""


class RunDirEvidence:
    """The ranks write into the run directory the watch reads (local; Slurm's shared one)."""

    def __init__(self, run_dir: Path, ranks: Sequence[int], attempt: int = 1) -> None:
        self.run_dir = run_dir
        self.ranks = list(ranks)
        self.attempt = attempt

    def heartbeats(self) -> dict[int, Heartbeat | None]:
        return read_heartbeats(self.run_dir, self.ranks)

    def joined(self) -> list[Joined]:
        return read_joined(self.run_dir, self.attempt)

    def collect(self, timeout_s: float) -> Collection:
        return collect(self.run_dir, self.ranks, timeout_s)


#: Busy ranks named one by one in the notice; more are counted.
NAMED_BUSY = 3


def held_off(hold: Hold, beats: Mapping[int, Heartbeat | None], nodes: Mapping[int, str]
             ) -> str:
    """The notice of a stall held off: ``no progress for 12 s, but not stalled: rank 0 (node
    a) in slow I/O at ckpt.py:40 `save` (write of /mnt/ckpt/x.pt), phase checkpoint; ...``."""
    parts = []
    for rank in sorted(hold.busy)[:NAMED_BUSY]:
        beat = beats.get(rank)
        node = nodes.get(rank) or (beat.host if beat is not None else None) or "?"
        text = f"rank {rank} (node {node}) {hold.busy[rank]}"
        if beat is not None:
            frame = innermost_user_frame(beat.user_stack or beat.stack, beat.stdlib)
            if frame is not None:
                text += f" at {frame.text()}"
            if beat.proc is not None and beat.proc.file_io():
                text += f" ({beat.proc.io_text()})"
            if beat.phase not in (None, "start", "running") and \
                    hold.busy[rank] != f"in {beat.phase}":
                text += f", phase {beat.phase}"
        parts.append(text)
    more = len(hold.busy) - NAMED_BUSY
    if more > 0:
        parts.append(f"{more} more rank{'s' if more > 1 else ''} busy")
    return (f"no progress for {hold.idle_s:.0f} s, but not stalled: {'; '.join(parts)} (a "
            f"stall only after distributed.busy_s, {hold.busy_s:.0f} s without progress)")


def handle_owners(node_of: Mapping[int, str], per_node: bool) -> dict[int, int]:
    """Each rank's process handle (what a launcher sees end): the rank itself, or its node's
    first rank where one launcher process starts the node's workers (``per_node``,
    ``torchrun``: the supervisor's handle and the Slurm task are recorded under it)."""
    firsts: dict[str, int] = {}
    for rank in sorted(node_of):
        firsts.setdefault(node_of[rank], rank)
    return {rank: firsts[node] if per_node else rank for rank, node in node_of.items()}


def living(owners: Mapping[int, int], running: Container[int]) -> dict[int, bool]:
    """Whether each rank's process runs, from the handles still ``running``. Every rank is in
    the map, so that one that has exited is known to have: the watch calls a rank hung at its
    exit only while it lives (docs/hangs.md, kind ``teardown``)."""
    return {rank: owner in running for rank, owner in owners.items()}


def look_interval_s(stall_s: float, heartbeat_s: float) -> float:
    """How often a watch looks: every beat, but no more than a tenth of the bound apart."""
    return max(heartbeat_s, min(5.0, stall_s / 10.0))


class HangWatch:
    """One attempt's stall watch (see the module docstring).

    ``nodes`` maps each rank to its node's name, ``master`` is ``addr:port`` and ``interface``
    the network interface of the plan (for the sentence of a transport stall). ``world_size``
    and ``launcher`` are the plan's, for the world check (:mod:`orchestrate.diagnosis.world`;
    None: no check); a ``stall_s`` of 0 turns the stall rule off and leaves the world check.
    ``busy_s`` is ``distributed.busy_s`` (None: the rule's default); ``notify`` gets the
    sentence said when busy ranks hold a stall off (the supervisor's log).
    """

    def __init__(
        self,
        run_dir: Path,
        source: Evidence,
        nodes: Mapping[int, str],
        master: str,
        *,
        stall_s: float,
        heartbeat_s: float,
        interface: str | None = None,
        collect_s: float = DEFAULT_COLLECT_S,
        world_size: int | None = None,
        launcher: str = "ranks",
        busy_s: float | None = None,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.source = source
        self.nodes = dict(nodes)
        self.master = master
        self.interface = interface
        self.collect_s = collect_s
        self.rule = StallWatch(stall_s, heartbeat_s, busy_s=busy_s) if stall_s > 0 else None
        self.notify = notify
        self.interval_s = look_interval_s(stall_s, heartbeat_s) if stall_s > 0 else heartbeat_s
        self.world = (world_size, launcher) if world_size is not None else None
        self.last: Diagnosis | None = None

    def look(self, alive: Mapping[int, bool] | None = None) -> Diagnosis | None:
        """One look: a ``wrong_world`` :class:`Diagnosis` the first time a process joined a
        process group that is not the plan's (once per attempt), or a stall's the first time
        the job counts as stalled (once per stall: the rule stays quiet until some rank
        progresses again), else None."""
        beats = self.source.heartbeats()
        found = self.world_check()
        if found is not None:
            return found
        if self.rule is None:
            return None
        stall = self.rule.observe(time.time(), beats, alive or {})
        hold = self.rule.take_hold()
        if hold is not None and self.notify is not None:
            self.notify(held_off(hold, beats, self.nodes))
        if stall is None:
            return None
        return self.name(stall, alive)

    def world_check(self) -> Diagnosis | None:
        """The world check alone: a ``wrong_world`` diagnosis the first time the records show
        one (the supervisor's last look when the ranks have ended, too), else None."""
        if self.world is None:
            return None
        found = wrong_world(self.source.joined(), *self.world, time.time())
        if found is not None:
            self.world = None  # said once
            write_diagnosis(self.run_dir, found)
            self.last = found
        return found

    def name(self, stall: Stall | None, alive: Mapping[int, bool] | None = None) -> Diagnosis:
        """Collect every rank's dump, classify and keep the diagnosis."""
        collected = self.source.collect(self.collect_s)
        beats = self.source.heartbeats()
        diagnosis = classify(beats, collected.answers, time.time(), self.nodes, self.master,
                             self.interface, stall=stall, alive=alive)
        write_diagnosis(self.run_dir, diagnosis, collected.id)
        self.last = diagnosis
        return diagnosis
