"""The local supervisor process: ``python -m orchestrate.backends.local.supervisor JOB STORE``.

Started detached by :class:`~orchestrate.backends.local.backend.LocalBackend`, it is a
:class:`~orchestrate.backends.supervisor.Supervisor` (the lifecycle of
:mod:`orchestrate.backends.base`). It starts a watchdog first
(:func:`orchestrate.backends.detached.start_watchdog`), so that ranks never outlive a supervisor
that is killed, even with SIGKILL; leases the plan's GPUs, CPU slots and port in this machine's
lease book, re-planning around what other jobs hold; writes the run directory and the record;
then starts one ``bash launch-<node>.sh LOCAL_RANK`` per rank (the script ``render`` prints; one
``bash launch-<node>.sh`` for the node under ``launcher: per_node`` or ``torchrun``) and
runs them to the end with the shared loop of :mod:`orchestrate.run.supervise`. Every attempt
runs on the same leases. The script is run by its path after the whole path was checked again
right before (:func:`orchestrate.backends.base.checked_script`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from orchestrate.backends.base import STOP_GRACE_S, checked_script
from orchestrate.backends.detached import start_watchdog, watchdog_modules
from orchestrate.backends.handshake import Handshake
from orchestrate.backends.local.backend import LocalBackend
from orchestrate.backends.sharing import (
    FOREIGN_POLL_S,
    blocked,
    book_error,
    foreign_gpu_use,
    health_on,
    host_health,
    lease_dir,
    node_claim,
    occupancy,
    ticket,
    wait_limit,
    wants,
)
from orchestrate.backends.supervisor import Supervisor
from orchestrate.core.errors import EXIT_BUSY, UserError
from orchestrate.core.layout import node_script_name
from orchestrate.core.plan.outcome import Exit
from orchestrate.core.plan.plan import Occupancy, Plan, checkpoint_dir
from orchestrate.core.plan.ports import PORT_BASE, PORT_SPAN, pick_port
from orchestrate.core.plan.rankenv import ATTEMPT_VAR
from orchestrate.core.plan.restart import progress_marker
from orchestrate.core.queueing import ends_within_s
from orchestrate.diagnosis.hangwatch import RunDirEvidence
from orchestrate.hostside import containment, gpuhealth, gpuuse, host, leases
from orchestrate.hostside.fairshare import rules
from orchestrate.hostside.outputlog import LINE_MAX
from orchestrate.run.supervise import Launched

if TYPE_CHECKING:
    from orchestrate.run.loaded import Prepared

class LocalRank:
    """One rank as a local process in its own process group; under a launcher that starts
    workers (``per_node``, ``torchrun``) the node's one process, recorded as its first rank
    (``local_rank`` None: the launch script takes no argument)."""

    def __init__(self, rank: int, node: str, local_rank: int | None, script: Path,
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
        self.pidfd: int | None = None  # readable once the process exits (:meth:`exit_fd`)

    def start(self, emit: Callable[[bytes], None]) -> int | None:
        """Run ``bash launch-<node>.sh [LOCAL_RANK]``; secrets go in on stdin."""
        argument = [] if self.local_rank is None else [str(self.local_rank)]
        self.proc = subprocess.Popen(
            ["bash", str(self.script), *argument],
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
        with contextlib.suppress(OSError, AttributeError):  # no pidfd (Linux < 5.3): polled
            self.pidfd = os.pidfd_open(self.proc.pid)
        return self.proc.pid

    def exit_fd(self) -> int | None:
        """The process's pidfd until its exit is seen: the supervisor's loop wakes on it."""
        return self.pidfd if self.exited_at is None else None

    def poll(self) -> Exit | None:
        """The exit, once the process ended and its output is drained (or 2 s passed)."""
        assert self.proc is not None and self.reader is not None
        code = self.proc.poll()
        if code is None:
            return None
        if self.exited_at is None:
            self.exited_at = time.monotonic()
            if self.pidfd is not None:
                os.close(self.pidfd)
                self.pidfd = None
        # Its last output is read once the pipe's end comes: at its exit, unless something it
        # started still holds the pipe (then up to 2 s).
        self.reader.join(timeout=0.01)
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
    """One local job's supervisor: a child subreaper, so that whatever its ranks start stays
    below it and is swept at the end of each attempt."""

    backend = LocalBackend()

    def __init__(self, job_id: str, store_path: Path) -> None:
        super().__init__(job_id, store_path)
        #: The lease book's folder of the node, once the first attempt claims.
        self.lease_root: str | None = None
        #: Outlives this process by a grace period, then stops what the job left and leaves its
        #: lease (started by the first claim).
        self.watchdog: subprocess.Popen[bytes] | None = None
        #: The job's cgroup on this machine, where one can be made and joined.
        self.group: containment.JobGroup | None = None
        #: What outlived the last stop: while they live they hold the lease (:meth:`end`).
        self.survivors: list[int] = []

    def begin(self, handshake: Handshake) -> None:
        """Become a subreaper first: whatever starts below this process stays below it."""
        containment.become_subreaper()

    def claim(self, attempt: int, excluded: tuple[str, ...]) -> Prepared | None:
        """Lease the GPUs, slots and port, re-planned around what other jobs hold and GPUs in
        use outside orchestrate, under the book's lock, behind older waiting jobs; this
        supervisor and its watchdog hold the lease. A restart runs on the same leases, unless
        one of its GPUs failed the health check since (:meth:`_recheck`)."""
        if attempt != self.first:
            return self._recheck()
        submitted = self.submitted
        source = str(submitted.path)
        node = submitted.plan.nodes[0]
        self.lease_root = lease_dir(submitted, node.name)
        if self.watchdog is None:  # before anything can start
            self.watchdog = start_watchdog(os.getpid(), self.job_id, STOP_GRACE_S,
                                           self.lease_root, _boxed(submitted))
        found = gpuuse.usage() if node.gpu_indices or _has_gpus(submitted) else None
        if found is not None and not found["ok"] and not found.get("missing"):
            raise UserError.single(str(found["detail"]), source=source, field="inventory",
                                   hint="orchestrate reads nvidia-smi to see which GPUs are "
                                   "in use; fix the driver, or run where it works")
        sick = self._health(found)
        try:
            book = leases.LeaseBook(self.lease_root)
            with book.locked():
                prepared = self._place(book, found, sick)
        except leases.BookError as exc:
            raise book_error(exc, source) from None
        return prepared

    def _health(self, found: dict[str, Any] | None) -> dict[int, str]:
        """This machine's GPUs that fail their health check (index -> why); what only warns,
        and what could not be checked, goes to the supervisor's log."""
        if found is None or not found.get("ok") or not health_on():
            return {}
        expected = node_claim(self.submitted, self.submitted.plan.nodes[0]).gpus
        verdict = host_health(gpuhealth.gather(), expected)
        for line in [*verdict.notes, *verdict.warnings(), *verdict.sick().values()]:
            self.log(f"GPU health: {line}")
        return verdict.sick()

    def _recheck(self) -> Prepared | None:
        """Before a restart: the job's GPUs checked again; one that went bad since the last
        attempt is left out, the job re-planned on other free GPUs (its lease moved with it)
        and the log says so; a job that no longer fits is refused (it ends, saying why)."""
        current = (self.prepared or self.submitted).plan.nodes[0]
        if not current.gpu_indices or not health_on():
            return None
        found = gpuuse.usage()
        sick = self._health(found)
        bad = sorted(set(current.gpu_indices) & set(sick))
        if not bad:
            return None
        self.log(f"restart: GPU(s) {', '.join(map(str, bad))} failed the health check since "
                 "the last attempt: planning the restart without them")
        source = str(self.submitted.path)
        try:
            book = leases.LeaseBook(self.lease_root)
            with book.locked():
                held = leases.held(book.live(except_job=self.job_id))
                outside = gpuuse.outside_use(found, set(held["gpus"])) if found.get("ok") else {}
                prepared = _fit(self.submitted, held, outside, sick)
                chosen = prepared.plan.nodes[0]
                book.record(leases.new_lease(
                    self.job_id, chosen.name, list(chosen.gpu_indices), 0,
                    prepared.plan.master_port, [os.getpid(), self._watchdog_pid()],
                    self.group.path if self.group else None,
                ).ending(ends_within_s(prepared.plan.time_limit)))
        except leases.BookError as exc:
            raise book_error(exc, source) from None
        self.log(f"restart: on GPU(s) {chosen.cuda_visible_devices} now")
        return prepared

    def _place(self, book: leases.LeaseBook, found: dict[str, Any] | None,
               sick: dict[int, str]) -> Prepared:
        """Inside the lock: plan around the book, or queue (a waiting job) and refuse."""
        submitted = self.submitted
        source = str(submitted.path)
        node = submitted.plan.nodes[0]
        held = leases.held(book.live(except_job=self.job_id))
        outside = gpuuse.outside_use(found, set(held["gpus"])) if found else {}
        waits = wait_limit(submitted) is not None
        me = os.getpid()
        want = (ticket(submitted, node, self.handshake.submitted_at, me, host.proc_start(me))
                if waits else wants(submitted, node))
        try:
            ahead = [leases.describe(t) for t in book.ahead(want, self.job_id)]
            refusal = blocked(held, ahead + rules(book, want, len(node.gpu_indices)), source)
            if refusal is not None:
                raise refusal
            prepared = _fit(submitted, held, outside, sick)
            _check_gpus_exist(prepared, found)
            _check_runtime(prepared)
        except UserError as exc:
            if isinstance(want, leases.Ticket) and exc.exit_status == EXIT_BUSY:
                book.enqueue(want)
            raise
        finally:
            for line in book.problems:  # files of the book it ignored or could not read
                self.log(f"lease book: {line}")
        plan = prepared.plan
        chosen = plan.nodes[0]
        key = f"{socket.gethostname()}.{os.geteuid()}.{self.job_id}"
        self.group = containment.JobGroup.make(key)
        book.record(leases.new_lease(
            self.job_id, chosen.name, list(chosen.gpu_indices),
            0 if chosen.gpu_indices else chosen.nproc, plan.master_port,
            [me, self._watchdog_pid()], self.group.path if self.group else None,
        ).ending(ends_within_s(plan.time_limit)))
        book.forget(self.job_id)
        return prepared

    def _watch_foreign(self) -> None:
        """While the job runs: another user's process on one of its GPUs is named in the job's
        log (once per process), in the run dir's list that ``status`` shows and in the
        attempt's ending (the owner of the job is told; nothing is stopped)."""
        while True:
            time.sleep(FOREIGN_POLL_S)
            self.foreign.update("", foreign_gpu_use(self.job_id, self.lease_root))

    def start_workers(self, prepared: Prepared, attempt: int) -> Launched:
        """A process per rank (or the node's one process under ``launcher: per_node`` or
        ``torchrun``), on this machine, running the node's launch script (in the job's cgroup
        where there is one: its children are born there)."""
        if self.group is not None and not self.group.join():
            self.group = None
        if attempt == self.first and prepared.plan.nodes[0].gpu_indices:
            threading.Thread(target=self._watch_foreign, daemon=True).start()
        plan = prepared.plan
        node = plan.nodes[0]
        script = checked_script(prepared, self.run_dir, node_script_name(node.name))
        secrets = [os.environ.get(name, "") for name in plan.secret_env]
        if plan.per_node:
            handles = [LocalRank(node.first_rank, node.name, None, script, secrets, attempt)]
        else:
            handles = [LocalRank(r.rank, r.node, r.local_rank, script, secrets, attempt)
                       for r in plan.ranks]
        evidence = RunDirEvidence(self.run_dir, [r.rank for r in plan.ranks], attempt)
        return Launched(handles, self._reap, evidence=evidence)

    def _reap(self) -> str | None:
        """The end of an attempt: what the ranks left, by tag, by ancestry (orphans re-parent
        here) and by cgroup; what even SIGKILL did not end is named (and keeps the lease)."""
        host.reap(self.job_id, STOP_GRACE_S, _boxed(self.submitted))
        me = os.getpid()
        skip = {self._watchdog_pid()}
        group = self.group

        def left() -> list[int]:
            found = set(containment.descendants(me, skip))
            if group is not None:
                found |= set(group.members({me, *skip}))
            return sorted(found)

        lingering = left()
        if lingering:  # what dropped the job tag: the supervisor's log names it
            self.log("stopping what the ranks left without the job tag (by ancestry or "
                     "cgroup): " + ", ".join(containment.describe_pid(p) for p in lingering[:5]))
        self.survivors = containment.stop_processes(left, STOP_GRACE_S)
        containment.reap_orphans(keep=skip)
        said = [survived(self.survivors), self.foreign.ending()]
        return "; ".join(words for words in said if words) or None

    def progress(self, plan: Plan) -> dict[str, int | None]:
        """From the run directory (on this machine)."""
        return progress_marker(str(self.run_dir), checkpoint_dir(plan))

    def abort(self) -> None:
        """Nothing runs: drop the lease and the ticket."""
        with contextlib.suppress(OSError, leases.BookError):
            leases.LeaseBook(self.lease_root).release(self.job_id)
        self._ungroup()

    def end(self) -> None:
        """Leave the lease: dropped, unless processes of the job survived (then they hold it
        while they live; the watchdog leaves it too once this process is gone)."""
        alive = [p for p in self.survivors if host.proc_start(p) is not None]
        self._ungroup()
        with contextlib.suppress(OSError, leases.BookError):
            leases.LeaseBook(self.lease_root).leave(
                self.job_id, [os.getpid(), self._watchdog_pid()], alive,
                [f"{containment.describe_pid(p)} outlived the job" for p in alive])

    def _watchdog_pid(self) -> int:
        return self.watchdog.pid if self.watchdog is not None else -1

    def _ungroup(self) -> None:
        if self.group is not None:
            self.group.leave()
            self.group.remove()


def survived(pids: list[int]) -> str | None:
    """The words a job's ending gets for processes that outlived it."""
    if not pids:
        return None
    named = ", ".join(containment.describe_pid(p) for p in pids[:5])
    more = f" and {len(pids) - 5} more" if len(pids) > 5 else ""
    return (f"{len(pids)} process(es) of the job still run after SIGKILL: {named}{more}; "
            "the job's lease stays held while they live")


def _boxed(prepared: Prepared) -> bool:
    """Whether the job runs in a container (whose removal the end of an attempt and the
    watchdog must ask podman or docker for); every attempt runs in the same one, or in none."""
    return any(node.container is not None for node in prepared.plan.nodes)


def _has_gpus(prepared: Prepared) -> bool:
    return node_claim(prepared, prepared.plan.nodes[0]).is_gpu


def _fit(prepared: Prepared, held: dict[str, Any],
         outside: Mapping[str, Mapping[str, Any]], sick: Mapping[int, str]) -> Prepared:
    """The plan again around what other jobs hold here (GPUs, slots, ports), the GPUs in use
    outside orchestrate and those that failed their health check, if it must (only then are
    the planner's spec models imported: orchestrate/run/loaded.py)."""
    plan = prepared.plan
    node = plan.nodes[0]
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
    fields = occupancy(node.name, held, outside, sick)
    if not port_busy and not fields:
        return prepared
    occupied = Occupancy(master_port=port if port != plan.master_port else None, **fields)
    from orchestrate.run.prepare import plan_job

    return plan_job(prepared.loaded, plan.job_id, occupied)


def _check_runtime(prepared: Prepared) -> None:
    """A job in a container needs its runtime here: refused before anything starts."""
    box = prepared.plan.nodes[0].container
    if box is not None and shutil.which(box.runtime) is None:
        raise UserError.single(
            f"{box.runtime} is not installed on this machine (not on PATH)",
            source=str(prepared.path), field="container.runtime", got=box.runtime,
            hint="install it (docs/containers.md), or choose a runtime this machine has")


def _check_gpus_exist(prepared: Prepared, found: dict[str, Any] | None) -> None:
    wanted = set(prepared.plan.nodes[0].gpu_indices)
    if not wanted:
        return
    present = {int(g["index"]) for g in found["gpus"]} if found and found.get("ok") else set()
    missing = sorted(wanted - present)
    if missing:
        raise UserError.single(
            f"GPU(s) {missing} of the plan are not on this machine "
            f"(nvidia-smi shows {sorted(present) or 'none'})",
            source=str(prepared.path), field="inventory",
            hint="check the inventory's CUDA indices, or drop 'inventory' to use this machine",
        )


def prewarm() -> None:
    """What every local launch computes alike, done by a supervisor started before planning
    while the CLI plans (:mod:`orchestrate.backends.early`): the built-in launch templates
    compiled (kept by :func:`orchestrate.core.render.render.environment`) and the watchdog's
    modules compressed (:func:`orchestrate.backends.detached.watchdog_modules`)."""
    from orchestrate.core.render.render import environment

    for name in ("node.sh.j2", "_header.sh.j2", "_container.sh.j2"):
        environment(None).get_template(name)
    watchdog_modules()


def main(argv: list[str]) -> int:
    """``python -m orchestrate.backends.local.supervisor JOB STORE`` (or its early start:
    :mod:`orchestrate.backends.early`)."""
    return LocalSupervisor(argv[0], Path(argv[1])).main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
