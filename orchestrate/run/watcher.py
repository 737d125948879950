"""The attempt's stall watch and world check, in a thread beside the supervisor's loop.

:func:`watch_attempt` makes the :class:`~orchestrate.diagnosis.hangwatch.HangWatch` of one
attempt (local and SSH: :mod:`orchestrate.run.supervise` runs it; the Slurm batch job runs its
own in ``monitor.py``); :class:`Watcher` runs its looks in a thread and hands the diagnoses to
the loop, which decides what they do to the job.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from pathlib import Path

from orchestrate.core.plan.plan import Plan
from orchestrate.diagnosis.hangwatch import Evidence, HangWatch, handle_owners, living
from orchestrate.diagnosis.stall import Diagnosis
from orchestrate.run.logsink import LogSink


class Watcher:
    """The stall watch in a thread of its own: a look can take seconds (a dump request waits
    for the ranks; an SSH job's evidence comes over the network) while the supervisor's loop
    must keep noticing exits every :data:`POLL_S`. Diagnoses come back through a queue."""

    def __init__(self, watch: HangWatch, sink: LogSink, owners: Mapping[int, int]) -> None:
        self.watch = watch
        self.sink = sink
        #: Each planned rank's handle (itself; a node's first rank where one launcher starts
        #: the node's workers): a rank lives while its handle runs.
        self.owners = owners
        #: The handles still running, replaced (never mutated) by the loop.
        self.alive: frozenset[int] = frozenset()
        self.found: queue.Queue[Diagnosis] = queue.Queue()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        failures = 0
        while not self.stopped.wait(self.watch.interval_s):
            try:
                diagnosis = self.watch.look(living(self.owners, self.alive))
                failures = 0
            except Exception as exc:  # the watch must never take the job down
                failures += 1
                if failures == 3:
                    self.sink.note(f"stall watch: cannot read the ranks' heartbeats "
                                   f"({type(exc).__name__}: {exc}); still trying")
                continue
            if diagnosis is not None and not self.stopped.is_set():
                self.found.put(diagnosis)

    def take(self) -> Diagnosis | None:
        try:
            return self.found.get_nowait()
        except queue.Empty:
            return None

    def stop(self) -> None:
        self.stopped.set()

    def last_look(self) -> Diagnosis | None:
        """Once the ranks have ended: a wrong world the thread found and the loop did not take
        yet, or one the records show now (a world that lived under a look's interval, or was
        re-initialised just before the end): such a job must not end COMPLETED."""
        self.stop()
        found = self.take()
        if found is not None and found.kind == "wrong_world":
            return found
        try:
            return self.watch.world_check()
        except Exception as exc:  # the watch must never take the job down
            self.sink.note(f"world check: cannot read the ranks' records ({exc})")
            return None


def watch_attempt(plan: Plan, run_dir: Path, evidence: Evidence | None, sink: LogSink
                  ) -> Watcher | None:
    """The attempt's stall watch and world check (the world check stays with ``stall_s: 0``),
    unless the job turned the sidecar off or the backend has no evidence."""
    if evidence is None or not plan.sidecar:
        return None
    nodes = {r.rank: r.node for r in plan.ranks}
    interface = plan.nodes[0].env.get("GLOO_SOCKET_IFNAME") if plan.nodes else None
    watch = HangWatch(run_dir, evidence, nodes, f"{plan.master_addr}:{plan.master_port}",
                      stall_s=plan.stall_s, heartbeat_s=plan.heartbeat_s,
                      interface=interface, world_size=plan.world_size,
                      launcher=plan.launcher, busy_s=plan.busy_s, notify=sink.note)
    return Watcher(watch, sink, handle_owners(nodes, plan.per_node))
