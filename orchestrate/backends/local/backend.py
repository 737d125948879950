"""The local backend: every rank a process on this machine, watched by a detached supervisor.

``submit`` refuses what it can see at once (a node of the plan that is another machine, a
missing working directory) and starts the supervisor (:mod:`orchestrate.backends.local.supervisor`)
in its own session, which leases GPUs, CPU slots and a free master port in this machine's lease
book (the same book SSH jobs on this machine use, :mod:`orchestrate.hostside.host`), re-plans
around what other jobs hold, writes the run directory and records the job, in the lifecycle of
:mod:`orchestrate.backends.base`. It outlives the CLI, so ``--detach`` and ``logs --follow`` work
the same way.
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.backends.base import STOP_GRACE_S, Backend, rank_files
from orchestrate.backends.detached import DetachedBackend
from orchestrate.core.errors import UserError
from orchestrate.run.store import JobRecord

if TYPE_CHECKING:
    from orchestrate.core.plan.plan import Plan
    from orchestrate.run.prepare import Prepared


class LocalBackend(DetachedBackend):
    """Runs jobs on this machine."""

    name = "local"
    poll_interval_s = 0.05  # a read of the local store: `submit --follow` ends with the job
    label = "local"
    supervisor_module = "orchestrate.backends.local.supervisor"

    def check_submit(self, prepared: Prepared) -> None:
        """A node that is another machine, or a working directory that does not exist."""
        _check_is_this_machine(prepared)
        if not Path(prepared.plan.workdir).is_dir():
            raise UserError.single(
                "the working directory does not exist", source=str(prepared.path),
                field="workdir", got=prepared.plan.workdir,
                hint="create it, or set workdir (relative to the job file)",
            )

    def files(self, plan: Plan, templates_dir: Path | None) -> dict[str, str]:
        """One ``launch-<node>.sh`` (run once per rank), the sidecar and ``train.json``."""
        from orchestrate.core.render.render import node_scripts

        return rank_files(plan, node_scripts(plan, templates_dir))

    def check(self, prepared: Prepared) -> None:
        """Nothing to ask beyond what ``submit`` checks: the plan is the whole story here."""

    def stop_everywhere(self, job: JobRecord) -> dict[str, str]:
        """Stop the job here (by tag, and by its cgroup), and let go of its lease: this machine
        is everywhere. Whatever survives SIGKILL keeps the lease held while it lives."""
        from orchestrate.hostside.watchdog import stop_job

        stop_job(job.id, STOP_GRACE_S, _lease_root(job))
        return {}


def _lease_root(job: JobRecord) -> str | None:
    """The book the job leased in: its inventory's lease_dir for the node, else the default.
    As the job's record names it; a record from before lease books were recorded asks the job's
    ``loaded.json`` (and, unreadable, the default book)."""
    from orchestrate.backends.base import reloaded
    from orchestrate.backends.sharing import lease_dir
    from orchestrate.run.prepare import Prepared

    if not job.plan.nodes:
        return None
    node = job.plan.nodes[0].name
    if job.lease_books is not None and node in job.lease_books:
        return job.lease_books[node]
    try:
        loaded = reloaded(job)
    except UserError:
        return None
    return lease_dir(Prepared(loaded, job.plan), node)


def _this_machine_names() -> set[str]:
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    with contextlib.suppress(OSError):
        names |= {str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None)}
    return names


def _check_is_this_machine(prepared: Prepared) -> None:
    """A local job whose inventory node is another machine is a mistake, not a fallback."""
    node = prepared.plan.nodes[0]
    if node.address.startswith("127.") or node.address == "::1":
        return
    if {node.name, node.address} & _this_machine_names():
        return
    raise UserError.single(
        f"node '{node.name}' ({node.address}) is not this machine, and the local backend "
        "runs here",
        source=str(prepared.path), field="backend",
        hint="use backend: ssh or slurm for other machines, or set resources.node_names to "
        "this machine's node",
    )


BACKEND: Backend = LocalBackend()  # mypy checks it keeps the protocol
