"""The SSH backend: ranks on bare servers reached over SSH, watched by a detached supervisor.

``submit`` starts ``python -m orchestrate.backends.ssh.supervisor JOB_ID STORE_PATH`` in its
own session, hands it the loaded and planned job (:class:`SSHHandshake`: no file is read again)
and waits for its verdict, in the lifecycle of :mod:`orchestrate.backends.base`. That supervisor
does everything over one set of connections (see :mod:`~orchestrate.backends.ssh.launcher`):
preflight on every host in parallel, a re-plan with what the hosts said (GPUs and CPU slots
other jobs lease, a free master port on the master host, the network interface towards
MASTER_ADDR), lease claims, copying the launch scripts, and then one pty channel per rank running
``bash <run_dir>/launch-<node>.sh LOCAL_RANK``, supervised by the same loop as local jobs. When a
check fails, the supervisor reports the per-host table and exits; ``submit`` prints it and exits
2 with nothing launched.

Stopping: the first failed rank, a cancel or Ctrl-C make the supervisor run kill-by-tag on every
host at once; if the supervisor itself dies, its channels close and each host's agent does the
same on SIGHUP; ``cancel`` without a supervisor runs kill-by-tag from the CLI
(:meth:`SSHBackend.stop_everywhere`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orchestrate.core.layout
import orchestrate.diagnosis.diagfiles
import orchestrate.diagnosis.evidence
import orchestrate.diagnosis.kernelstate
import orchestrate.diagnosis.rankview
import orchestrate.diagnosis.stacks
import orchestrate.diagnosis.stall
import orchestrate.diagnosis.stallrule
from orchestrate.backends.base import STOP_GRACE_S, Backend, rank_files
from orchestrate.backends.detached import DetachedBackend
from orchestrate.backends.handshake import Handshake
from orchestrate.core.errors import UserError
from orchestrate.core.layout import EVIDENCE_PROGRAM, SSH_HOSTS
from orchestrate.hostside.shipping import Manifest, program
from orchestrate.run.store import JobRecord

if TYPE_CHECKING:
    from typing import Self

    from orchestrate.backends.ssh.connections import Target
    from orchestrate.core.plan.plan import Plan
    from orchestrate.run.prepare import Prepared


@dataclass(frozen=True)
class Login:
    """A host to log into at once, and how many rank channels to open there."""

    target: Target
    nproc: int

    def to_json(self) -> dict[str, Any]:
        """As JSON values."""
        return {"target": self.target.to_json(), "nproc": self.nproc}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Login:
        """The inverse of :meth:`to_json`."""
        from orchestrate.backends.ssh.connections import Target

        return cls(Target.from_json(dict(data["target"])), int(data["nproc"]))


@dataclass(frozen=True)
class SSHHandshake(Handshake):
    """The job, and the hosts its plan uses: the supervisor starts logging into them before it
    has imported or decoded anything else (logins are what costs; they need no plan)."""

    hosts: tuple[Login, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """As JSON values (one line on the supervisor's stdin)."""
        return {**super().to_json(), "hosts": [h.to_json() for h in self.hosts]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        """The inverse of :meth:`to_json`."""
        return cls(**cls.fields_of(data),
                   hosts=tuple(Login.from_json(h) for h in data.get("hosts", ())))


class SSHBackend(DetachedBackend):
    """Runs jobs on the inventory's hosts over SSH."""

    name = "ssh"
    label = "SSH"
    supervisor_module = "orchestrate.backends.ssh.supervisor"

    def handshake(self, prepared: Prepared, attempt: int | None) -> SSHHandshake:
        """The job, and the planned hosts to log into first."""
        from orchestrate.backends.ssh.connections import targets_for

        plan = prepared.plan
        targets = targets_for(plan, prepared.inventory, plan.ssh.connect_timeout_s)
        return SSHHandshake(**vars(super().handshake(prepared, attempt)),
                            hosts=tuple(Login(targets[n.name], n.nproc) for n in plan.nodes))

    def files(self, plan: Plan, templates_dir: Path | None) -> dict[str, str]:
        """One ``launch-<node>.sh`` per host, the sidecar, ``evidence.py`` (what a host runs to
        read its ranks' heartbeats) and ``train.json``; each host gets its own script and the
        rest (:meth:`~orchestrate.backends.ssh.launcher.Launcher.copy`)."""
        from orchestrate.core.render.render import node_scripts

        return rank_files(plan, node_scripts(plan, templates_dir),
                          {EVIDENCE_PROGRAM: evidence_program()})

    def check(self, prepared: Prepared) -> None:
        """``submit --dry-run``: run the preflight (read-only) and print the per-host table."""
        from orchestrate.backends.ssh.connections import targets_for
        from orchestrate.backends.ssh.launcher import Launcher
        from orchestrate.backends.ssh.preflight import host_table, problems
        from orchestrate.backends.ssh.sessions import HostPool

        pool = HostPool(prepared.plan.ssh.fanout, secrets=[])
        launcher = Launcher(prepared, replan=_no_replan, pool=pool)
        try:
            verdict = launcher.check(prepared.plan, with_ranks=False)
        finally:
            launcher.abort()
        plan = prepared.plan
        targets = targets_for(plan, prepared.inventory, plan.ssh.connect_timeout_s)
        host_table(verdict, targets).print(only_failed=False)
        if not verdict.ok:
            raise UserError(problems(verdict, str(prepared.path)))

    def stop_everywhere(self, job: JobRecord) -> dict[str, str]:
        """Kill-by-tag on every host of the job at once (which also drops its lease there);
        failure reasons by host."""
        from orchestrate.backends.ssh.connections import Links
        from orchestrate.backends.ssh.reaping import sweep

        links = Links()
        try:
            return sweep(links, job_targets(job), job.id, STOP_GRACE_S, job.plan.ssh.fanout)
        finally:
            links.close()


#: ``evidence.py``, what an SSH host runs to read its ranks' heartbeats and dumps: the run
#: directory's names, the diag records, the stall rule and classifier, the reader.
EVIDENCE = Manifest("evidence", (
    orchestrate.core.layout, orchestrate.diagnosis.kernelstate, orchestrate.diagnosis.diagfiles,
    orchestrate.diagnosis.stallrule, orchestrate.diagnosis.stacks, orchestrate.diagnosis.rankview,
    orchestrate.diagnosis.stall, orchestrate.diagnosis.evidence))


def evidence_program() -> str:
    """``evidence.py``: what an SSH host runs to read its ranks' heartbeats and dumps."""
    return program(EVIDENCE, "from orchestrate.diagnosis.evidence import main\n"
                             "sys.exit(main(sys.argv[1:]))")


def job_targets(job: JobRecord) -> list[Target]:
    """How to reach the job's hosts, from its run directory."""
    from orchestrate.backends.ssh.connections import Target

    try:
        data = json.loads((Path(job.run_dir) / SSH_HOSTS).read_text())
    except (OSError, ValueError):
        return []
    return [Target.from_json(item) for item in data]


def _no_replan(*_args: object) -> Prepared:
    raise AssertionError("a dry run never re-plans")


BACKEND: Backend = SSHBackend()  # mypy checks it keeps the protocol
