"""The SSH backend: ranks on bare servers reached over SSH, watched by a detached supervisor.

``submit`` starts ``python -m orchestrate.backends.ssh JOB_ID STORE_PATH`` in its own session
and waits for its verdict. That supervisor does everything over one set of connections (see
:mod:`~orchestrate.backends.sshkit.launcher`): preflight on every host in parallel, a re-plan
with what the hosts said (GPUs other jobs lease, a free master port on the master host, the
network interface towards MASTER_ADDR), lease claims, copying the launch scripts, and then one
pty channel per rank running ``bash <run_dir>/launch-<node>.sh LOCAL_RANK``, supervised by the
same loop as local jobs. When a check fails, the supervisor reports the per-host table and
exits; ``submit`` prints it and exits 2 with nothing launched.

Stopping: the first failed rank, a cancel or Ctrl-C make the supervisor run kill-by-tag on every
host at once; if the supervisor itself dies, its channels close and each host's agent does the
same on SIGHUP; ``cancel`` without a supervisor runs kill-by-tag from the CLI.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from orchestrate.backends.base import new_record, write_run_dir
from orchestrate.backends.local import secret_values
from orchestrate.errors import Problem, UserError
from orchestrate.layout import MERGED_LOG, SSH_HOSTS, SUPERVISOR_LOG
from orchestrate.lease import holder_alive
from orchestrate.store import JobRecord, Store

if TYPE_CHECKING:
    from orchestrate.backends.sshkit.connections import Target
    from orchestrate.prepare import Prepared

#: How long a rank gets between SIGTERM and SIGKILL (the entrypoint checkpoints in between).
STOP_GRACE_S = 5.0
#: Longest ``submit`` waits for the supervisor's verdict (its own steps all have deadlines).
VERDICT_TIMEOUT_S = 900.0


class SSHBackend:
    """Runs jobs on the inventory's hosts over SSH."""

    name = "ssh"

    def submit(self, prepared: Prepared, store: Store) -> JobRecord:
        """Start the supervisor; return once it launched the job, or raise what failed."""
        secret_values(prepared.plan.secret_env, str(prepared.path))
        plan = prepared.plan
        run_dir = Path(plan.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        from orchestrate.backends.sshkit.connections import targets_for

        # The supervisor runs in this cwd, so relative paths (ORCHESTRATE_RUNS=runs) agree. It
        # starts logging into the planned hosts before it has imported and planned itself.
        targets = targets_for(plan, prepared.inventory, prepared.job.ssh.connect_timeout_s)
        handshake = {
            "job_file": str(prepared.path.resolve()),
            "overrides": list(prepared.overrides),
            "submitted_at": time.time(),
            "fanout": prepared.job.ssh.fanout,
            "secret_env": list(plan.secret_env),  # names only; values stay in the environment
            "hosts": [{"target": targets[n.name].to_json(), "nproc": n.nproc} for n in plan.nodes],
        }
        with open(run_dir / SUPERVISOR_LOG, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrate.backends.ssh", plan.job_id, str(store.path)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                start_new_session=True,
            )
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

    def dry_run_check(self, prepared: Prepared) -> None:
        """``submit --dry-run``: run the preflight (read-only) and print the per-host table."""
        from rich.console import Console

        from orchestrate.backends.sshkit.connections import targets_for
        from orchestrate.backends.sshkit.launcher import Launcher
        from orchestrate.backends.sshkit.preflight import problems, table
        from orchestrate.backends.sshkit.sessions import HostPool

        pool = HostPool(prepared.job.ssh.fanout, secrets=[])
        launcher = Launcher(prepared, replan=_no_replan, pool=pool)
        try:
            verdict = launcher.check(prepared.plan, with_ranks=False)
        finally:
            launcher.abort()
        targets = targets_for(prepared.plan, prepared.inventory, prepared.job.ssh.connect_timeout_s)
        Console(file=sys.stderr, width=200 if not sys.stderr.isatty() else None).print(
            table(verdict, targets, only_failed=False))
        if not verdict.ok:
            raise UserError(problems(verdict, str(prepared.path)))

    def refresh(self, job: JobRecord, store: Store) -> JobRecord:
        """A running job whose supervisor (on this machine) is gone has failed: stop what may be
        left on its hosts and say so."""
        if job.terminal or job.supervisor_pid is None:
            return job
        if job.supervisor_host not in (None, socket.gethostname()):
            return job
        if holder_alive(job.supervisor_pid, job.id):
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
        pid = job.supervisor_pid
        local = job.supervisor_host in (None, socket.gethostname())
        stopped_cleanly = False
        if pid is not None and local and holder_alive(pid, job.id):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S + 30
            while time.monotonic() < deadline and holder_alive(pid, job.id):
                current = store.get(job.id)
                if current is not None and current.terminal:
                    stopped_cleanly = True
                    break
                time.sleep(0.05)
            if holder_alive(pid, job.id):
                os.kill(pid, signal.SIGKILL)
                stopped_cleanly = False
        reason = "cancelled"
        if not stopped_cleanly:
            reason += _unreached(stop_everywhere(job))
        store.finish(job.id, "CANCELLED", reason)
        return store.get(job.id) or job


def _unreached(failed: Mapping[str, str]) -> str:
    if not failed:
        return ""
    return "; could not reach " + ", ".join(f"{h} ({why})" for h, why in failed.items())


def job_targets(job: JobRecord) -> list[Target]:
    """How to reach the job's hosts, from its run directory."""
    from orchestrate.backends.sshkit.connections import Target

    try:
        data = json.loads((Path(job.run_dir) / SSH_HOSTS).read_text())
    except (OSError, ValueError):
        return []
    return [Target.from_json(item) for item in data]


def stop_everywhere(job: JobRecord) -> dict[str, str]:
    """Kill-by-tag on every host of the job at once; failure reasons by host."""
    from orchestrate.backends.sshkit.connections import Links
    from orchestrate.backends.sshkit.reaping import sweep

    targets = job_targets(job)
    links = Links()
    try:
        fanout = int(job.plan.get("ssh", {}).get("fanout", 32))
        return sweep(links, targets, job.id, STOP_GRACE_S, fanout)
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

    from orchestrate.backends.sshkit.connections import Target
    from orchestrate.backends.sshkit.preflight import Judgement, table

    targets = {name: Target.from_json(t) for name, t in table_data["targets"].items()}
    judged = Judgement(
        cells=table_data["cells"],
        failures=[(targets[name], check, detail) for name, check, detail in table_data["failures"]],
    )
    Console(file=sys.stderr, width=200 if not sys.stderr.isatty() else None).print(
        table(judged, targets, only_failed=True))


def _no_replan(*_args: object) -> Prepared:
    raise AssertionError("a dry run never re-plans")


# ---------------------------------------------------------------------------- the supervisor


class _Verdict:
    """The one line ``submit`` waits for, on the supervisor's original stdout."""

    def __init__(self) -> None:
        self.fd: int | None = os.dup(1)
        os.dup2(2, 1)  # anything else printed goes to the supervisor log

    def send(self, verdict: dict[str, Any]) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, (json.dumps(verdict) + "\n").encode())
        except OSError:
            pass  # submit is gone (Ctrl-C): the record in the store says the rest
        finally:
            os.close(self.fd)
            self.fd = None


def _log(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def run_supervisor(job_id: str, store_path: Path) -> int:
    """The supervisor process's body: launch the job, then run its ranks to the end."""
    from orchestrate.backends.sshkit.connections import Target, preload
    from orchestrate.backends.sshkit.sessions import HostPool

    handshake = json.loads(sys.stdin.readline() or "{}")
    verdict = _Verdict()
    job_file = Path(handshake["job_file"])
    try:
        secrets = secret_values(tuple(handshake.get("secret_env", ())), str(job_file))
    except UserError as exc:
        verdict.send({"ok": False, "problems": [asdict(p) for p in exc.problems]})
        return 2
    # Log into the hosts submit planned while this process imports and plans (the logins are
    # what costs; they need no plan). SSH first: imports hold the GIL the handshakes need.
    preload()
    pool = HostPool(int(handshake.get("fanout", 32)), secrets)
    for host in handshake.get("hosts", []):
        pool.open(Target.from_json(host["target"]), int(host["nproc"]))

    from orchestrate.backends.sshkit.launcher import Cancelled, Launcher, PreflightFailed
    from orchestrate.backends.sshkit.reaping import HostStopper
    from orchestrate.prepare import prepare
    from orchestrate.supervise import StopRequest, supervise

    stop = StopRequest()
    stop.install()
    store = Store(store_path)
    overrides = tuple(handshake.get("overrides", ()))

    def replan(busy: Mapping[str, frozenset[int]], port: int | None,
               interfaces: Mapping[str, str]) -> Prepared:
        return prepare(job_file, overrides, job_id=job_id, busy_gpus=busy or None,
                       master_port=port, interfaces=interfaces or None)

    started = time.monotonic()
    _log(f"up after {time.time() - float(handshake.get('submitted_at', time.time())):.2f}s "
         "(since submit started)")
    launcher: Launcher | None = None
    try:
        prepared = prepare(job_file, overrides, job_id=job_id)
        _log(f"planned in {time.monotonic() - started:.2f}s")
        launcher = Launcher(prepared, replan, pool, lambda: stop.reason, _log)
        prepared = launcher.settle()
        launcher.copy(prepared)
    except PreflightFailed as failed:
        from orchestrate.backends.sshkit.preflight import problems

        _log(f"preflight failed: {failed.verdict.failures}")
        pool.close(abort_all=True)
        verdict.send({
            "ok": False,
            "problems": [asdict(p) for p in problems(failed.verdict, str(job_file))],
            "table": {
                "targets": {n: t.to_json() for n, t in failed.targets.items()},
                "cells": failed.verdict.cells,
                "failures": [[t.name, c, d] for t, c, d in failed.verdict.failures],
            },
        })
        return 2
    except (UserError, Cancelled) as exc:
        pool.close(abort_all=True)
        problems_ = exc.problems if isinstance(exc, UserError) else (
            Problem(f"not launched: {exc}", source=str(job_file)),)
        verdict.send({"ok": False, "problems": [asdict(p) for p in problems_]})
        return 2
    except BaseException as exc:
        _log("".join(traceback.format_exception(exc)))
        pool.close(abort_all=True)
        verdict.send({"ok": False, "problems": [asdict(Problem(
            f"the SSH launch failed: {type(exc).__name__}: {exc}", source=str(job_file),
            hint=f"details in {Path(prepared_run_dir(job_file, job_id)) / SUPERVISOR_LOG}"))]})
        return 1

    plan = prepared.plan
    run_dir = write_run_dir(prepared)
    targets = launcher.targets(plan)
    (run_dir / SSH_HOSTS).write_text(
        json.dumps([t.to_json() for t in targets.values()], indent=2) + "\n")
    record = new_record(prepared, "PENDING", float(handshake.get("submitted_at", time.time())))
    record.supervisor_pid = os.getpid()
    record.supervisor_host = socket.gethostname()
    hostnames = launcher.hostnames()
    for rank in record.ranks:
        rank.host = hostnames.get(rank.node)
    store.add(record)
    _log(f"launching {plan.world_size} rank(s) on {len(plan.nodes)} host(s) after "
         f"{time.monotonic() - started:.2f}s ({launcher.timings})")
    verdict.send({"ok": True, "timings": launcher.timings})

    stopper = HostStopper(launcher.links, targets, job_id, STOP_GRACE_S,
                          note=lambda text: _note(run_dir, text))
    handles = launcher.handles(plan, stopper, STOP_GRACE_S)
    for handle in handles:
        handle.prime()

    def cleanup() -> None:
        # Hosts whose agent saw nothing of the job left when a rank ended are clean already;
        # the others (a rank lost, a process left behind) get kill-by-tag.
        clean = {h.node for h in handles if h.left_host_clean}
        stopper.sweep(launcher.fanout, skip=clean)
        pool.close(abort_all=False)

    outcome = supervise(job_id, run_dir, store, handles, stop, STOP_GRACE_S, cleanup)
    return 0 if outcome.state == "COMPLETED" else 1


def prepared_run_dir(job_file: Path, job_id: str) -> str:
    """The run directory of ``job_id`` (for messages before a plan exists)."""
    from orchestrate.job import load_job
    from orchestrate.prepare import run_root

    try:
        return str(run_root(load_job(job_file), job_file) / job_id)
    except UserError:
        return "."


def _note(run_dir: Path, text: str) -> None:
    """A line from orchestrate in the merged log (and the supervisor log)."""
    _log(text)
    with open(run_dir / MERGED_LOG, "a", encoding="utf-8") as merged:
        merged.write(f"[orchestrate] {text}\n")


BACKEND = SSHBackend()

if __name__ == "__main__":
    sys.exit(run_supervisor(sys.argv[1], Path(sys.argv[2])))
