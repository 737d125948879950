"""The SSH backend: ranks on bare servers reached over SSH, watched by a detached supervisor.

``submit`` starts ``python -m orchestrate.backends.ssh.supervisor JOB_ID STORE_PATH`` in its
own session, hands it the loaded job (no file is read again), and waits for its verdict. That
supervisor does everything over one set of connections (see
:mod:`~orchestrate.backends.ssh.launcher`): preflight on every host in parallel, a re-plan
with what the hosts said (GPUs and CPU slots other jobs lease, a free master port on the master
host, the network interface towards MASTER_ADDR), lease claims, copying the launch scripts, and
then one pty channel per rank running ``bash <run_dir>/launch-<node>.sh LOCAL_RANK``, supervised
by the same loop as local jobs. When a check fails, the supervisor reports the per-host table and
exits; ``submit`` prints it and exits 2 with nothing launched.

Stopping: the first failed rank, a cancel or Ctrl-C make the supervisor run kill-by-tag on every
host at once; if the supervisor itself dies, its channels close and each host's agent does the
same on SIGHUP; ``cancel`` without a supervisor runs kill-by-tag from the CLI.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from orchestrate.backends import detached
from orchestrate.backends.base import STOP_GRACE_S, rank_files, secret_values
from orchestrate.core.errors import Problem, UserError
from orchestrate.core.layout import EVIDENCE_PROGRAM, SSH_HOSTS, SUPERVISOR_LOG
from orchestrate.hostside.shipping import shipped
from orchestrate.run.store import JobRecord, Store

if TYPE_CHECKING:
    from orchestrate.backends.ssh.connections import Target
    from orchestrate.core.plan.plan import Plan
    from orchestrate.run.prepare import Prepared

SUPERVISOR = "orchestrate.backends.ssh.supervisor"
#: Longest ``submit`` waits for the supervisor's verdict (its own steps all have deadlines).
VERDICT_TIMEOUT_S = 900.0


class SSHBackend:
    """Runs jobs on the inventory's hosts over SSH."""

    name = "ssh"
    poll_interval_s = 0.2

    def submit(self, prepared: Prepared, store: Store) -> JobRecord:
        """Start the supervisor; return once it launched the job, or raise what failed."""
        return self._start(prepared, store, None)

    def resume(self, job: JobRecord, prepared: Prepared, store: Store) -> JobRecord:
        """The next attempt, through a new supervisor (preflight, leases, launch as at submit)."""
        return self._start(prepared, store, job)

    def _start(self, prepared: Prepared, store: Store, again: JobRecord | None) -> JobRecord:
        secret_values(prepared.plan.secret_env, str(prepared.path))
        plan = prepared.plan
        run_dir = Path(plan.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        from orchestrate.backends.ssh.connections import targets_for

        # The supervisor starts logging into the planned hosts before it has imported anything
        # else; it plans again from `loaded` alone, with what the hosts say.
        targets = targets_for(plan, prepared.inventory, plan.ssh.connect_timeout_s)
        handshake = {
            "loaded": prepared.loaded.to_json(),
            "job_id": plan.job_id,
            "submitted_at": time.time(),
            "fanout": plan.ssh.fanout,
            "secret_env": list(plan.secret_env),  # names only; values stay in the environment
            "hosts": [{"target": targets[n.name].to_json(), "nproc": n.nproc} for n in plan.nodes],
            "attempt": None if again is None else again.attempt + 1,
        }
        # Its cwd is this one, so relative paths (ORCHESTRATE_RUNS=runs) agree.
        proc = detached.start(SUPERVISOR, plan.job_id, store, run_dir, pipe=True)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write((json.dumps(handshake) + "\n").encode())
            proc.stdin.close()
            verdict = _read_verdict(proc.stdout, VERDICT_TIMEOUT_S)
        except BaseException:
            proc.terminate()  # Ctrl-C while waiting: the supervisor aborts, launching nothing
            raise
        finally:
            proc.stdout.close()
        if verdict is None:
            if proc.poll() is None:
                proc.terminate()
            raise UserError.single(
                "the SSH supervisor ended before launching the job",
                source=str(prepared.path),
                hint=f"its log: {run_dir / SUPERVISOR_LOG}",
            )
        if not verdict.get("ok"):
            _print_table(verdict)
            raise UserError([Problem(**p) for p in verdict.get("problems", [])])
        record = store.get(plan.job_id)
        assert record is not None
        return record

    def files(self, plan: Plan, templates_dir: Path | None) -> dict[str, str]:
        """One ``launch-<node>.sh`` per host, the sidecar, ``evidence.py`` (what a host runs to
        read its ranks' heartbeats) and ``train.json``; each host gets its own script and the
        rest (:meth:`~orchestrate.backends.ssh.launcher.Launcher.copy`)."""
        from orchestrate.core.render.render import node_scripts

        return rank_files(plan, node_scripts(plan, templates_dir),
                          {EVIDENCE_PROGRAM: evidence_program()})

    def check(self, prepared: Prepared) -> None:
        """``submit --dry-run``: run the preflight (read-only) and print the per-host table."""
        from rich.console import Console

        from orchestrate.backends.ssh.connections import targets_for
        from orchestrate.backends.ssh.launcher import Launcher
        from orchestrate.backends.ssh.preflight import problems, table
        from orchestrate.backends.ssh.sessions import HostPool

        pool = HostPool(prepared.plan.ssh.fanout, secrets=[])
        launcher = Launcher(prepared, replan=_no_replan, pool=pool)
        try:
            verdict = launcher.check(prepared.plan, with_ranks=False)
        finally:
            launcher.abort()
        plan = prepared.plan
        targets = targets_for(plan, prepared.inventory, plan.ssh.connect_timeout_s)
        Console(file=sys.stderr, width=200 if not sys.stderr.isatty() else None).print(
            table(verdict, targets, only_failed=False))
        if not verdict.ok:
            raise UserError(problems(verdict, str(prepared.path)))

    def refresh(self, job: JobRecord, store: Store) -> JobRecord:
        """A running job whose supervisor (on this machine) is gone has failed: stop what may be
        left on its hosts and say so."""
        if job.terminal or job.supervisor_pid is None or not detached.on_this_machine(job):
            return job
        if detached.alive(job.supervisor_pid, job.id):
            return job
        failed = stop_everywhere(job)
        store.finish(job.id, "FAILED",
                     "the job's supervisor process vanished" + _unreached(failed))
        return store.get(job.id) or job

    def cancel(self, job: JobRecord, store: Store) -> JobRecord:
        """SIGTERM the supervisor (it stops every rank on every host); without a supervisor,
        kill-by-tag on every host from here."""
        if job.terminal:
            return job
        reason = "cancelled"
        if not detached.stop(job, store, STOP_GRACE_S + 30):
            reason += _unreached(stop_everywhere(job))
        store.finish(job.id, "CANCELLED", reason)
        return store.get(job.id) or job


def evidence_program() -> str:
    """``evidence.py``: what an SSH host runs to read its ranks' heartbeats and dumps."""
    return shipped("evidence", "from orchestrate.diagnosis.evidence import main\n"
                               "sys.exit(main(sys.argv[1:]))")


def _unreached(failed: Mapping[str, str]) -> str:
    if not failed:
        return ""
    return "; could not reach " + ", ".join(f"{h} ({why})" for h, why in failed.items())


def job_targets(job: JobRecord) -> list[Target]:
    """How to reach the job's hosts, from its run directory."""
    from orchestrate.backends.ssh.connections import Target

    try:
        data = json.loads((Path(job.run_dir) / SSH_HOSTS).read_text())
    except (OSError, ValueError):
        return []
    return [Target.from_json(item) for item in data]


def stop_everywhere(job: JobRecord) -> dict[str, str]:
    """Kill-by-tag on every host of the job at once; failure reasons by host."""
    from orchestrate.backends.ssh.connections import Links
    from orchestrate.backends.ssh.reaping import sweep

    targets = job_targets(job)
    links = Links()
    try:
        return sweep(links, targets, job.id, STOP_GRACE_S, job.plan.ssh.fanout)
    finally:
        links.close()


def _read_verdict(stream: IO[bytes], timeout: float) -> dict[str, Any] | None:
    """The supervisor's one-line verdict, or None if it ended (or hung) without one."""
    deadline = time.monotonic() + timeout
    data = b""
    fd = stream.fileno()
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        data += chunk
    verdict: dict[str, Any] = json.loads(data.split(b"\n", 1)[0])
    return verdict


def _print_table(verdict: dict[str, Any]) -> None:
    table_data = verdict.get("table")
    if not table_data:
        return
    from rich.console import Console

    from orchestrate.backends.ssh.connections import Target
    from orchestrate.backends.ssh.preflight import Judgement, table

    targets = {name: Target.from_json(t) for name, t in table_data["targets"].items()}
    judged = Judgement(
        cells=table_data["cells"],
        failures=[(targets[name], check, detail) for name, check, detail in table_data["failures"]],
    )
    Console(file=sys.stderr, width=200 if not sys.stderr.isatty() else None).print(
        table(judged, targets, only_failed=True))


def _no_replan(*_args: object) -> Prepared:
    raise AssertionError("a dry run never re-plans")


BACKEND = SSHBackend()
