"""The local supervisor process: ``python -m orchestrate.backends.local.supervisor JOB STORE``.

Started detached by :class:`~orchestrate.backends.local.backend.LocalBackend`, it is a
:class:`~orchestrate.backends.supervisor.Supervisor` (the lifecycle of
:mod:`orchestrate.backends.base`). It starts a watchdog first
(:func:`orchestrate.backends.detached.start_watchdog`), so that ranks never outlive a supervisor
that is killed, even with SIGKILL; leases the plan's GPUs, CPU slots and port in this machine's
lease book, re-planning around what other jobs hold; writes the run directory and the record;
then starts one ``bash launch-<node>.sh LOCAL_RANK`` per rank (the script ``render`` prints) and
runs them to the end with the shared loop of :mod:`orchestrate.run.supervise`. Every attempt
runs on the same leases.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from orchestrate.backends.base import STOP_GRACE_S
from orchestrate.backends.detached import start_watchdog
from orchestrate.backends.handshake import Handshake
from orchestrate.backends.local.backend import LocalBackend
from orchestrate.backends.supervisor import Supervisor
from orchestrate.core.errors import UserError
from orchestrate.core.layout import node_script_name
from orchestrate.core.plan.outcome import Exit
from orchestrate.core.plan.plan import Occupancy, Plan, checkpoint_dir
from orchestrate.core.plan.ports import PORT_BASE, PORT_SPAN, pick_port
from orchestrate.core.plan.rankenv import ATTEMPT_VAR
from orchestrate.core.plan.restart import progress_marker
from orchestrate.diagnosis.hangwatch import RunDirEvidence
from orchestrate.hostside import host
from orchestrate.hostside.outputlog import LINE_MAX
from orchestrate.run.supervise import Launched

if TYPE_CHECKING:
    from orchestrate.run.prepare import Prepared

class LocalRank:
    """One rank as a local process in its own process group."""

    def __init__(self, rank: int, node: str, local_rank: int, script: Path,
                 secrets: list[str], attempt: int = 1) -> None:
        self.rank = rank
        self.node = node
        self.local_rank = local_rank
        self.script = script
        self.secrets = secrets
        self.attempt = attempt
        self.lost: str | None = None  # a local process is never lost: it exits
        self.proc: subprocess.Popen[bytes] | None = None
        self.reader: threading.Thread | None = None
        self.exited_at: float | None = None

    def start(self, emit: Callable[[bytes], None]) -> int | None:
        """Run ``bash launch-<node>.sh LOCAL_RANK``; secrets go in on stdin."""
        self.proc = subprocess.Popen(
            ["bash", str(self.script), str(self.local_rank)],
            stdin=subprocess.PIPE if self.secrets else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=self.script.parent, start_new_session=True,
            env={**os.environ, ATTEMPT_VAR: str(self.attempt)},
        )
        if self.secrets and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("".join(v + "\n" for v in self.secrets).encode())
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        assert self.proc.stdout is not None
        self.reader = threading.Thread(target=_pump, args=(self.proc.stdout, emit), daemon=True)
        self.reader.start()
        return self.proc.pid

    def poll(self) -> Exit | None:
        """The exit, once the process ended and its output is drained (or 2 s passed)."""
        assert self.proc is not None and self.reader is not None
        code = self.proc.poll()
        if code is None:
            return None
        if self.exited_at is None:
            self.exited_at = time.monotonic()
        if self.reader.is_alive() and time.monotonic() - self.exited_at < 2.0:
            return None
        return Exit(signal=-code) if code < 0 else Exit(code=code)

    def stop(self, force: bool) -> None:
        """Signal the rank's whole process group."""
        if self.proc is None or self.proc.poll() is not None:
            return
        sigs = (signal.SIGKILL,) if force else (signal.SIGTERM, signal.SIGCONT)
        for sig in sigs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)


def _pump(stream: IO[bytes], emit: Callable[[bytes], None]) -> None:
    """The rank's output as it comes, a line (or LINE_MAX bytes of a longer one) at a time."""
    for raw in iter(lambda: stream.readline(LINE_MAX), b""):
        emit(raw)
    stream.close()


class LocalSupervisor(Supervisor):
    """One local job's supervisor."""

    backend = LocalBackend()

    def begin(self, handshake: Handshake) -> None:
        """The watchdog, before anything can start."""
        start_watchdog(os.getpid(), self.job_id, STOP_GRACE_S)

    def claim(self, attempt: int, excluded: tuple[str, ...]) -> Prepared | None:
        """Lease the GPUs, slots and port, re-planned around other jobs' leases, under the lease
        book's lock; this supervisor holds the lease. A restart runs on the same leases."""
        if attempt != self.first:
            return None
        book = host.LeaseBook()
        with book.locked():
            prepared = _fit(self.submitted, host.held(book.live()))
            _check_gpus_exist(prepared)
            plan = prepared.plan
            node = plan.nodes[0]
            book.record(host.new_lease(
                self.job_id, node.name, list(node.gpu_indices),
                0 if node.gpu_indices else node.nproc, plan.master_port, os.getpid(),
            ))
        return prepared

    def start_workers(self, prepared: Prepared, attempt: int) -> Launched:
        """A process per rank, on this machine, running the node's launch script."""
        plan = prepared.plan
        script = self.run_dir / node_script_name(plan.nodes[0].name)
        secrets = [os.environ.get(name, "") for name in plan.secret_env]
        handles = [LocalRank(r.rank, r.node, r.local_rank, script, secrets, attempt)
                   for r in plan.ranks]
        evidence = RunDirEvidence(self.run_dir, [r.rank for r in plan.ranks])
        return Launched(handles, self._reap, evidence=evidence)

    def _reap(self) -> None:
        host.reap(self.job_id, STOP_GRACE_S)  # what a rank left (it may have left its session)

    def progress(self, plan: Plan) -> dict[str, int | None]:
        """From the run directory (on this machine)."""
        return progress_marker(str(self.run_dir), checkpoint_dir(plan))

    def abort(self) -> None:
        """Nothing runs: drop the lease."""
        self.end()

    def end(self) -> None:
        """Drop the job's lease (the watchdog would, once this process is gone)."""
        with contextlib.suppress(OSError):
            host.LeaseBook().release(self.job_id)


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
    if port_busy and plan.port_fixed:  # busy: exit 75, try again when it is free
        why = "held by another orchestrate job" if port in taken else "in use"
        raise UserError.single(
            f"master port {port} is {why} on this machine",
            source=str(prepared.path), field="distributed.master_port",
            hint="choose another port or 'auto', or try again when it is free", busy=True,
        )
    if port_busy:
        found = pick_port(port, taken, host.port_free)
        if found is None:
            raise UserError.single(f"no free port in {PORT_BASE}-{PORT_BASE + PORT_SPAN - 1}",
                                   field="distributed.master_port", busy=True)
        port = found
    if not port_busy and not busy_gpus and not busy_slots:
        return prepared
    occupancy = Occupancy(
        busy_gpus={node.name: busy_gpus} if busy_gpus else {},
        busy_slots={node.name: busy_slots} if busy_slots else {},
        master_port=port if port != plan.master_port else None,
    )
    return plan_job(prepared.loaded, plan.job_id, occupancy)


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


if __name__ == "__main__":
    sys.exit(LocalSupervisor(sys.argv[1], Path(sys.argv[2])).main())
