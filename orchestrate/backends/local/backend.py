"""The local backend: every rank a process on this machine, watched by a detached supervisor.

``submit`` leases GPUs, CPU slots and a free master port in this machine's lease book (the same
book SSH jobs on this machine use, :mod:`orchestrate.hostside.host`), re-plans around what other
jobs hold, writes the run directory, and starts the supervisor
(:mod:`orchestrate.backends.local.supervisor`)
in its own session. It outlives the CLI, so ``--detach`` and ``logs --follow`` work the same way.
"""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.backends import detached
from orchestrate.backends.base import (
    STOP_GRACE_S,
    new_record,
    rank_files,
    secret_values,
    write_run_dir,
)
from orchestrate.core.errors import UserError
from orchestrate.core.plan.outcome import Attempt
from orchestrate.core.plan.plan import Occupancy, Plan
from orchestrate.core.plan.ports import PORT_BASE, PORT_SPAN, pick_port
from orchestrate.hostside import host
from orchestrate.run.store import JobRecord, Store

if TYPE_CHECKING:
    from orchestrate.run.prepare import Prepared

SUPERVISOR = "orchestrate.backends.local.supervisor"


class LocalBackend:
    """Runs jobs on this machine."""

    name = "local"
    poll_interval_s = 0.2

    def submit(self, prepared: Prepared, store: Store) -> JobRecord:
        """Lease GPUs, slots and a port, write the run directory, start the supervisor."""
        secret_values(prepared.plan.secret_env, str(prepared.path))
        _check_is_this_machine(prepared)
        if not Path(prepared.plan.workdir).is_dir():
            raise UserError.single(
                "the working directory does not exist", source=str(prepared.path),
                field="workdir", got=prepared.plan.workdir,
                hint="create it, or set workdir (relative to the job file)",
            )
        return self._launch(prepared, store, None)

    def resume(self, job: JobRecord, prepared: Prepared, store: Store) -> JobRecord:
        """The next attempt of an ended job, planned again around today's leases."""
        secret_values(prepared.plan.secret_env, str(prepared.path))
        return self._launch(prepared, store, job)

    def _launch(self, prepared: Prepared, store: Store, again: JobRecord | None) -> JobRecord:
        """Lease, write the run directory, record the job (or its next attempt), start the
        supervisor, all under the lease book's lock."""
        book = host.LeaseBook()
        with book.locked():
            prepared = _fit(prepared, host.held(book.live()))
            plan = prepared.plan
            _check_gpus_exist(prepared)
            run_dir = write_run_dir(prepared, self.files(plan, prepared.templates_dir))
            if again is None:
                store.add(new_record(prepared, "PENDING", time.time()))
            else:
                store.reopen(plan.job_id, Attempt(again.attempt + 1, time.time()))
                store.update(plan.job_id, plan=plan)
            proc = detached.start(SUPERVISOR, plan.job_id, store, run_dir, cwd=run_dir)
            node = plan.nodes[0]
            book.record(host.new_lease(
                plan.job_id, node.name, list(node.gpu_indices),
                0 if node.gpu_indices else node.nproc, plan.master_port, proc.pid,
            ))
        store.update(plan.job_id, supervisor_pid=proc.pid, supervisor_host=socket.gethostname())
        record = store.get(plan.job_id)
        assert record is not None
        return record

    def files(self, plan: Plan, templates_dir: Path | None) -> dict[str, str]:
        """One ``launch-<node>.sh`` (run once per rank), the sidecar and ``train.json``."""
        from orchestrate.core.render.render import node_scripts

        return rank_files(plan, node_scripts(plan, templates_dir))

    def check(self, prepared: Prepared) -> None:
        """Nothing to ask beyond what ``submit`` checks: the plan is the whole story here."""

    def refresh(self, job: JobRecord, store: Store) -> JobRecord:
        """A running job whose supervisor is gone has failed: say so and clean up."""
        if job.terminal or job.supervisor_pid is None:
            return job
        if detached.alive(job.supervisor_pid, job.id):
            return job
        host.reap(job.id, STOP_GRACE_S)
        store.finish(job.id, "FAILED", "the job's supervisor process vanished")
        with contextlib.suppress(OSError):
            host.LeaseBook().release(job.id)
        return store.get(job.id) or job

    def cancel(self, job: JobRecord, store: Store) -> JobRecord:
        """SIGTERM the supervisor (it stops every rank); make sure nothing is left."""
        if job.terminal:
            return job
        detached.stop(job, store, STOP_GRACE_S + 10)
        host.reap(job.id, STOP_GRACE_S)
        store.finish(job.id, "CANCELLED", "cancelled")
        with contextlib.suppress(OSError):
            host.LeaseBook().release(job.id)
        return store.get(job.id) or job


def _fit(prepared: Prepared, held: dict[str, Any]) -> Prepared:
    """The plan again around what other jobs hold here (GPUs, slots, ports), if it must."""
    from orchestrate.run.prepare import plan_job

    plan = prepared.plan
    node = plan.nodes[0]
    busy_gpus = frozenset(int(g) for g in held["gpus"])
    busy_slots = int(held["slots"])
    taken = {int(p) for p in held["ports"]}
    port = plan.master_port
    port_busy = port in taken or not host.port_free(port)
    if port_busy and plan.port_fixed:
        raise UserError.single(
            f"master port {port} is in use on this machine",
            source=str(prepared.path), field="distributed.master_port",
            hint="choose another port or 'auto'",
        )
    if port_busy:
        found = pick_port(port, taken, host.port_free)
        if found is None:
            raise UserError.single(f"no free port in {PORT_BASE}-{PORT_BASE + PORT_SPAN - 1}",
                                   field="distributed.master_port")
        port = found
    if not port_busy and not busy_gpus and not busy_slots:
        return prepared
    facts = Occupancy(
        busy_gpus={node.name: busy_gpus} if busy_gpus else {},
        busy_slots={node.name: busy_slots} if busy_slots else {},
        master_port=port if port != plan.master_port else None,
    )
    return plan_job(prepared.loaded, plan.job_id, facts)


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


def _check_gpus_exist(prepared: Prepared) -> None:
    wanted = set(prepared.plan.nodes[0].gpu_indices)
    if not wanted:
        return
    from orchestrate.probe.machine import probe_gpus

    present = {g.index for g in probe_gpus()}
    missing = sorted(wanted - present)
    if missing:
        raise UserError.single(
            f"GPU(s) {missing} of the plan are not on this machine "
            f"(nvidia-smi shows {sorted(present) or 'none'})",
            source=str(prepared.path), field="inventory",
            hint="check the inventory's CUDA indices, or drop 'inventory' to use this machine",
        )


BACKEND = LocalBackend()
