"""The local backend: every rank a process on this machine, watched by a detached supervisor.

``submit`` leases GPUs and a free master port (so several jobs can share one server), writes the
run directory, and starts ``python -m orchestrate.backends.local JOB_ID`` in its own session.
That supervisor starts one ``bash launch-<node>.sh LOCAL_RANK`` per rank (the script ``render``
prints), and outlives the CLI, so ``--detach`` and ``logs --follow`` work the same way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING

from orchestrate import reaper
from orchestrate.backends.base import new_record, write_run_dir
from orchestrate.backends.sshkit.agent import port_free
from orchestrate.errors import UserError
from orchestrate.layout import SUPERVISOR_LOG, node_script_name
from orchestrate.lease import LeaseBook, holder_alive, new_lease
from orchestrate.ports import PORT_BASE, PORT_SPAN, pick_port
from orchestrate.store import JobRecord, Store, home
from orchestrate.supervise import Exit, StopRequest, supervise

if TYPE_CHECKING:
    from orchestrate.prepare import Prepared

#: How long a rank gets between SIGTERM and SIGKILL (the entrypoint checkpoints in between).
STOP_GRACE_S = 5.0


def lease_book() -> LeaseBook:
    """This machine's leases."""
    return LeaseBook(home() / "leases")


def secret_values(names: tuple[str, ...], source: str) -> list[str]:
    """The secret env values from this environment, refusing missing or multi-line ones."""
    values = []
    for name in names:
        value = os.environ.get(name)
        if value is None:
            raise UserError.single(
                f"{name} is not set in your environment", source=source, field="secret_env",
                hint=f"export {name}=... before submitting; its value is never written to a file",
            )
        if "\n" in value:
            raise UserError.single(f"{name} holds a line break", source=source,
                                   field="secret_env")
        values.append(value)
    return values


class LocalBackend:
    """Runs jobs on this machine."""

    name = "local"

    def submit(self, prepared: Prepared, store: Store) -> JobRecord:
        """Lease GPUs and a port, write the run directory, start the supervisor."""
        secret_values(prepared.plan.secret_env, str(prepared.path))
        book = lease_book()
        with book.locked() as leases:
            busy = frozenset(g for lease in leases for g in lease.gpus)
            taken = {lease.port for lease in leases if lease.port is not None}
            plan = prepared.plan
            node = plan.nodes[0]
            if busy & set(node.gpu_indices):
                prepared = self._replan(prepared, busy_gpus={node.name: busy})
                plan = prepared.plan
            _check_is_this_machine(prepared)
            _check_gpus_exist(prepared)
            port = plan.master_port
            if port in taken or not port_free(port):
                if plan.port_fixed:
                    raise UserError.single(
                        f"master port {port} is in use on this machine",
                        source=str(prepared.path), field="distributed.master_port",
                        hint="choose another port or 'auto'",
                    )
                found = pick_port(port, taken, port_free)
                if found is None:
                    raise UserError.single(
                        f"no free port in {PORT_BASE}-{PORT_BASE + PORT_SPAN - 1}",
                        field="distributed.master_port",
                    )
                port = found
                prepared = self._replan(
                    prepared, busy_gpus={node.name: busy} if busy else None, master_port=port
                )
                plan = prepared.plan
            run_dir = write_run_dir(prepared)
            record = new_record(prepared, "PENDING", time.time())
            store.add(record)
            log = open(run_dir / SUPERVISOR_LOG, "ab")  # noqa: SIM115
            with log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "orchestrate.backends.local", plan.job_id,
                     str(store.path)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    start_new_session=True, cwd=run_dir,
                )
            chosen = plan.nodes[0]
            book.write(new_lease(plan.job_id, chosen.name, chosen.gpu_indices, port, proc.pid))
        store.update(plan.job_id, supervisor_pid=proc.pid, supervisor_host=socket.gethostname())
        record.supervisor_pid = proc.pid
        return record

    @staticmethod
    def _replan(
        prepared: Prepared,
        busy_gpus: Mapping[str, frozenset[int]] | None,
        master_port: int | None = None,
    ) -> Prepared:
        from orchestrate.prepare import prepare

        return prepare(
            prepared.path, prepared.overrides, job_id=prepared.plan.job_id,
            busy_gpus=busy_gpus, master_port=master_port,
        )

    def refresh(self, job: JobRecord, store: Store) -> JobRecord:
        """A running job whose supervisor is gone has failed: say so and clean up."""
        if job.terminal or job.supervisor_pid is None:
            return job
        if holder_alive(job.supervisor_pid, job.id):
            return job
        reaper.reap(job.id)
        store.finish(job.id, "FAILED", "the job's supervisor process vanished")
        lease_book().release(job.id)
        return store.get(job.id) or job

    def cancel(self, job: JobRecord, store: Store) -> JobRecord:
        """SIGTERM the supervisor (it stops every rank); make sure nothing is left."""
        if job.terminal:
            return job
        pid = job.supervisor_pid
        if pid is not None and holder_alive(pid, job.id):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S + 10
            while time.monotonic() < deadline and holder_alive(pid, job.id):
                current = store.get(job.id)
                if current is not None and current.terminal:
                    break
                time.sleep(0.05)
            if holder_alive(pid, job.id):
                os.kill(pid, signal.SIGKILL)
        reaper.reap(job.id)
        store.finish(job.id, "CANCELLED", "cancelled")
        lease_book().release(job.id)
        return store.get(job.id) or job


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
    from orchestrate.machine import probe_gpus

    present = {g.index for g in probe_gpus()}
    missing = sorted(wanted - present)
    if missing:
        raise UserError.single(
            f"GPU(s) {missing} of the plan are not on this machine "
            f"(nvidia-smi shows {sorted(present) or 'none'})",
            source=str(prepared.path), field="inventory",
            hint="check the inventory's CUDA indices, or drop 'inventory' to use this machine",
        )


class LocalRank:
    """One rank as a local process in its own process group."""

    def __init__(self, rank: int, node: str, local_rank: int, script: Path,
                 secrets: list[str]) -> None:
        self.rank = rank
        self.node = node
        self.local_rank = local_rank
        self.script = script
        self.secrets = secrets
        self.proc: subprocess.Popen[bytes] | None = None
        self.reader: threading.Thread | None = None
        self.exited_at: float | None = None

    def start(self, emit: Callable[[str], None]) -> int | None:
        """Run ``bash launch-<node>.sh LOCAL_RANK``; secrets go in on stdin."""
        self.proc = subprocess.Popen(
            ["bash", str(self.script), str(self.local_rank)],
            stdin=subprocess.PIPE if self.secrets else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=self.script.parent, start_new_session=True,
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


def _pump(stream: IO[bytes], emit: Callable[[str], None]) -> None:
    for raw in iter(stream.readline, b""):
        emit(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
    stream.close()


def run_supervisor(job_id: str, store_path: Path) -> int:
    """The supervisor process's body: run the job's ranks to the end."""
    store = Store(store_path)
    job = store.get(job_id)
    if job is None:
        return 2
    stop = StopRequest()
    stop.install()
    run_dir = Path(job.run_dir)
    node = job.plan["nodes"][0]
    script = run_dir / node_script_name(node["name"])
    secrets = [os.environ.get(name, "") for name in job.plan.get("secret_env", [])]
    handles = [
        LocalRank(r["rank"], r["node"], r["local_rank"], script, secrets)
        for r in job.plan["ranks"]
    ]

    def cleanup() -> None:
        reaper.reap(job_id, grace_s=STOP_GRACE_S)
        lease_book().release(job_id)

    outcome = supervise(job_id, run_dir, store, handles, stop, STOP_GRACE_S, cleanup)
    return 0 if outcome.state == "COMPLETED" else 1


BACKEND = LocalBackend()

if __name__ == "__main__":
    sys.exit(run_supervisor(sys.argv[1], Path(sys.argv[2])))
