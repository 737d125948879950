"""The SSH supervisor process: ``python -m orchestrate.backends.ssh.supervisor JOB STORE``.

Started detached by :class:`~orchestrate.backends.ssh.backend.SSHBackend`, it is a
:class:`~orchestrate.backends.supervisor.Supervisor` (the lifecycle of
:mod:`orchestrate.backends.base`). It reads its handshake
(:class:`~orchestrate.backends.ssh.backend.SSHHandshake`) and logs into the planned hosts at
once, before it imports or decodes anything else; then each attempt -- the first, and every
restart -- is the same launch sequence: the plan (a restart's planned again without the nodes the
restart policy excluded), :meth:`~orchestrate.backends.ssh.launcher.Launcher.settle` (preflight,
re-plans with what the hosts say, lease claims), the files copied to each host, the run
directory and ``ssh-hosts.json`` written here, the rank rows recorded; then the ranks run to the
end with the shared loop of :mod:`orchestrate.run.supervise`.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.backends.base import STOP_GRACE_S, secret_values
from orchestrate.backends.handshake import Handshake, Verdict
from orchestrate.backends.sharing import ticket, wait_limit
from orchestrate.backends.ssh.backend import SSHBackend, SSHHandshake
from orchestrate.backends.supervisor import Supervisor
from orchestrate.core.errors import EXIT_BUSY, Problem, UserError
from orchestrate.core.layout import SSH_HOSTS

if TYPE_CHECKING:
    from collections.abc import Callable

    from orchestrate.backends.sharing import ForeignWatch
    from orchestrate.backends.ssh.channels import AgentChannel, SSHRank
    from orchestrate.backends.ssh.launcher import Launcher
    from orchestrate.backends.ssh.sessions import HostPool
    from orchestrate.backends.ssh.spares import Spares
    from orchestrate.core.plan.plan import NodePlan, Occupancy, Plan
    from orchestrate.run.prepare import Prepared
    from orchestrate.run.supervise import Launched


#: How long an attempt's end waits for rank 0's agent to say how far training got.
PROGRESS_ASK_S = 2.0


class SSHSupervisor(Supervisor):
    """One SSH job's supervisor: one set of connections per attempt, from check to launch."""

    backend = SSHBackend()
    handshake_type = SSHHandshake
    wait_poll_s = 1.0  # a waiting job asks every host again: one request each

    def __init__(self, job_id: str, store_path: Path) -> None:
        super().__init__(job_id, store_path)
        self.pool: HostPool | None = None
        self.secrets: list[str] = []
        # Made by each attempt's :meth:`claim`: the property :attr:`launcher`.
        self._launcher: Launcher | None = None
        #: How far the attempt that just ended got, asked before its agents were let go.
        self._ended_progress: dict[str, int | None] | None = None
        #: The next attempt's agents, started on the kept connections while this one runs.
        self._spares: Spares | None = None

    @property
    def launcher(self) -> Launcher:
        """The attempt's launcher: its connections, preflight, claims and copies."""
        assert self._launcher is not None, "claim() makes the launcher first"
        return self._launcher

    def begin(self, handshake: Handshake) -> None:
        """Log into the hosts ``submit`` planned while this process imports and plans (the
        logins are what costs; they need no plan). SSH first: imports hold the GIL the
        handshakes need."""
        assert isinstance(handshake, SSHHandshake)
        from orchestrate.backends.ssh.connections import preload
        from orchestrate.backends.ssh.sessions import HostPool

        plan = handshake.plan
        self.secrets = secret_values(plan.secret_env, handshake.source)
        preload()
        self.pool = HostPool(plan.ssh.fanout, self.secrets)
        for login in handshake.hosts:
            self.pool.open(login.target, login.nproc)
        self.log(f"up after {time.time() - handshake.submitted_at:.2f}s (since submit started)")

    def claim(self, attempt: int, excluded: tuple[str, ...]) -> Prepared:
        """Preflight, re-plan and claim on every host (a restart: over the last attempt's
        connections and the spare agents started on them, or, avoiding ``excluded`` nodes,
        over new ones with fresh agents, the job planned again without them)."""
        from orchestrate.backends.ssh.launcher import Launcher
        from orchestrate.backends.ssh.sessions import HostPool
        from orchestrate.core.plan.plan import Occupancy
        from orchestrate.run.prepare import plan_job

        loaded = self.submitted.loaded
        prepared = self.submitted
        previous = self._launcher
        kept = None
        if attempt != self.first:
            # A restart keeps the last attempt's connections (no new login), unless it avoids
            # a node; hosts the new plan does not use are logged out of once it is settled.
            kept = self.pool.links if self.pool is not None and not excluded else None
            if self.pool is not None and kept is None:
                self.pool.links.close()
            spares, self._spares = self._spares, None
            if spares is not None and kept is None:  # other hosts: fresh agents
                spares.close()
                spares = None
            self.pool = HostPool(self.submitted.plan.ssh.fanout, self.secrets, kept, spares)
            prepared = plan_job(loaded, self.job_id, Occupancy(excluded=frozenset(excluded)))
        assert self.pool is not None

        def replan(found: Occupancy) -> Prepared:
            return plan_job(loaded, self.job_id, _also(found, excluded))

        tickets = None
        if attempt == self.first and wait_limit(self.submitted) is not None:
            submitted_at = self.handshake.submitted_at

            def tickets(node: NodePlan) -> dict[str, Any]:
                return ticket(self.submitted, node, submitted_at, 0, None).to_dict()

        self._launcher = Launcher(prepared, replan, self.pool, lambda: self.stop.reason, self.log,
                                  tickets)
        if kept is not None and previous is not None:
            # The hosts kept answered the last attempt's preflight with torch imported: this
            # one asks again (leases, GPUs, ports) without importing it (seconds a host).
            self.launcher.follow(previous)
        self.timings = self.launcher.timings
        try:
            settled = self.launcher.settle()
            if attempt != self.first:
                self.log(f"attempt {attempt} placed, {self.pool.spares_taken} spare agent(s) "
                         f"taken ({self.timings})")
            used = {node.name for node in settled.plan.nodes}
            self.pool.links.close([name for name in self.pool.links.links if name not in used])
            return settled
        except UserError as exc:
            if tickets is not None and exc.exit_status == EXIT_BUSY:
                self.launcher.enqueue()
            raise
        finally:
            if self.pool.spares is not None:  # those no host took: closed (they exit)
                self.pool.spares.close()

    def ship(self, prepared: Prepared, files: dict[str, str]) -> None:
        """Each host's files into the run directory there; here, how to reach the hosts later
        (``ssh-hosts.json``, for ``cancel`` and ``diagnose`` without a supervisor)."""
        self.launcher.copy(prepared, files)
        targets = self.launcher.targets(prepared.plan)
        (self.run_dir / SSH_HOSTS).write_text(
            json.dumps([t.to_json() for t in targets.values()], indent=2) + "\n")

    def hostnames(self) -> dict[str, str]:
        """What each host said it is called."""
        return self.launcher.hostnames()

    def start_workers(self, prepared: Prepared, attempt: int) -> Launched:
        """The rank handles on the channels the preflight opened; stopping is kill-by-tag."""
        from orchestrate.backends.ssh.evidence import RemoteEvidence
        from orchestrate.backends.ssh.reaping import HostStopper
        from orchestrate.core.plan.outcome import Exit
        from orchestrate.run.logsink import LogSink
        from orchestrate.run.supervise import Launched

        plan, launcher, pool = prepared.plan, self.launcher, self.launcher.pool
        sink = LogSink(self.run_dir, {r.rank: r.node for r in plan.ranks}, plan.log_cap_bytes)

        def note(text: str) -> None:
            self.log(text)
            sink.note(text)

        stopper = HostStopper(launcher.links, launcher.targets(plan), self.job_id, STOP_GRACE_S,
                              note=note)
        handles = launcher.handles(plan, stopper, STOP_GRACE_S, attempt)
        watch = self.foreign
        watch.log = note  # the job's log too: the owner is told there
        for handle in handles:
            handle.channel.on_foreign = _told(watch, handle.node)
            handle.prime()
        self._start_spares(plan, attempt, [h.channel for h in handles])

        def cleanup() -> str | None:
            # How far training got, asked of rank 0's agent while it still serves: the restart
            # decision reads it (then it took a shell and an interpreter on the host, 0.2 s).
            self._ended_progress = self._progress_before_end(plan, handles)
            # Each agent stops what its rank left below it (orphans re-parent to it) and
            # leaves the lease; hosts whose agent saw nothing of the job left when a rank
            # ended are clean already; the others (a rank lost, a process left behind) get
            # kill-by-tag.
            left = _finish_all(handles, STOP_GRACE_S)
            stopper.sweep(launcher.fanout, skip={h.node for h in handles if h.left_host_clean})
            pool.close(abort_all=False, keep_links=True)  # for a restart; end() logs out
            if self._spares is not None and not self.stop.reason \
                    and not all(h.channel.exit == Exit(0) for h in handles):
                self._spares.refill()  # a restart may follow: those with no room beside ranks
            for node, names in stopper.survivors.items():
                left.setdefault(node, []).extend(names)
            said = [_survived(left), watch.ending()]
            return "; ".join(words for words in said if words) or None

        evidence = RemoteEvidence(plan, launcher.targets(plan), launcher.links, launcher.fanout,
                                  self.run_dir, attempt, note)
        return Launched(handles, cleanup, sink, evidence)

    def _start_spares(self, plan: Plan, attempt: int, ranks: list[AgentChannel]) -> None:
        """The next attempt's agents (:mod:`.spares`), where a restart can follow this one."""
        from orchestrate.backends.ssh.spares import Spares

        if self._spares is not None:
            self._spares.close()
            self._spares = None
        if attempt - self.first >= plan.restart.max or self.pool is None:
            return
        self._spares = Spares(self.pool.links, self.launcher.targets(plan),
                              {node.name: node.nproc for node in plan.nodes}, self.secrets)
        self._spares.start(ranks)

    def progress(self, plan: Plan) -> dict[str, int | None]:
        """Read on the host of rank 0 (no shared file system is assumed): before an attempt's
        ranks start, on rank 0's agent channel (logged in and idle until its ``start``)."""
        from orchestrate.backends.ssh.reaping import progress_on

        if self._ended_progress is not None:  # the attempt that just ended, asked at its end
            found, self._ended_progress = self._ended_progress, None
            return found
        kept = self.pool.links if self.pool is not None else None
        sessions = self.pool.sessions() if self.pool is not None else {}
        first = sessions.get(plan.nodes[0].name)
        idle = first.channels[0] if first is not None and first.channels else None
        if idle is not None and (idle.started or not idle.is_ready):
            idle = None
        return progress_on(plan, self.launcher.targets(plan), kept, idle)

    def _progress_before_end(self, plan: Plan, handles: list[SSHRank]
                             ) -> dict[str, int | None] | None:
        """Rank 0's host's progress markers, asked on an agent of that host whose rank ended
        and that still serves; None where no restart can follow or none serves."""
        from orchestrate.backends.ssh.reaping import ask_progress

        first = plan.nodes[0].name
        serving = [h.channel for h in handles if h.node == first and not h.channel.ended.is_set()]
        if not plan.restart.max or not serving:
            return None
        # Briefly: a cancel's cleanup must not wait on a host that stopped answering (None:
        # asked later the way that needs no agent).
        return ask_progress(serving[0], plan, PROGRESS_ASK_S)

    def refusal(self, exc: BaseException) -> Verdict | None:
        """A failed check (with the per-host table), or a cancel before the launch."""
        from orchestrate.backends.ssh.launcher import Cancelled, PreflightFailed
        from orchestrate.backends.ssh.preflight import host_table, problems

        if isinstance(exc, PreflightFailed):
            self.log(f"preflight failed: {exc.verdict.failures}")
            return Verdict(ok=False, problems=tuple(problems(exc.verdict, self.handshake.source)),
                           table=host_table(exc.verdict, exc.targets))
        if isinstance(exc, Cancelled):
            return Verdict(ok=False, problems=(
                Problem(f"not launched: {exc}", source=self.handshake.source),))
        return None

    def abort(self) -> None:
        """Tell every agent nothing starts (each releases its claim), and log out."""
        self._close_spares()
        if self.pool is not None:
            self.pool.close(abort_all=True)

    def end(self) -> None:
        """The job ended: log out of the hosts (each attempt's end kept its connections for a
        restart; closing them ends every agent left there, spares too)."""
        self._close_spares()
        if self.pool is not None:
            self.pool.links.close()

    def _close_spares(self) -> None:
        if self._spares is not None:
            self._spares.close()
            self._spares = None


def _finish_all(handles: list[SSHRank], grace_s: float) -> dict[str, list[str]]:
    """Tell every rank's agent the job is over, all at once; what survived, by node."""
    from concurrent.futures import ThreadPoolExecutor

    if not handles:
        return {}
    timeout = grace_s + 15.0
    with ThreadPoolExecutor(max_workers=min(32, len(handles))) as pool:
        results = list(pool.map(lambda h: (h.node, h.finish(grace_s, timeout)), handles))
    left: dict[str, list[str]] = {}
    for node, names in results:
        if names:
            left.setdefault(node, []).extend(names)
    return left


def _told(watch: ForeignWatch, node: str) -> Callable[[dict[int, str]], None]:
    """What a node's agent says of other users on the job's GPUs, for ``watch``."""
    def update(uses: dict[int, str]) -> None:
        watch.update(node, uses)

    return update


def _survived(left: dict[str, list[str]]) -> str | None:
    """The words a job's ending gets for processes that outlived it, host by host."""
    if not left:
        return None
    count = sum(len(names) for names in left.values())
    named = "; ".join(f"on {node}: {', '.join(names)}" for node, names in left.items())
    return (f"{count} process(es) of the job still run after SIGKILL ({named}); the job's "
            "lease stays held there while they live")


def _also(more: Occupancy, excluded: tuple[str, ...]) -> Occupancy:
    """What preflight found, with the nodes the restart policy excluded kept out."""
    return replace(more, excluded=more.excluded | frozenset(excluded))


def main(argv: list[str]) -> int:
    """``python -m orchestrate.backends.ssh.supervisor JOB STORE`` (or its early start:
    :mod:`orchestrate.backends.early`)."""
    return SSHSupervisor(argv[0], Path(argv[1])).main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
