"""The SSH supervisor process: ``python -m orchestrate.backends.ssh.supervisor JOB STORE``.

Started detached by :class:`~orchestrate.backends.ssh.backend.SSHBackend`, which writes one
handshake line on its stdin (the loaded job, the hosts it planned, the names of the secrets) and
waits for
one verdict line on its stdout. It logs into the planned hosts at once, plans from the loaded
job (re-planning with what the hosts say, never reading the job file), launches, then runs the
ranks to the end with the shared loop of :mod:`orchestrate.run.supervise`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.backends.base import STOP_GRACE_S, new_record, secret_values, write_run_dir
from orchestrate.backends.ssh.backend import BACKEND
from orchestrate.core.errors import Problem, UserError
from orchestrate.core.layout import SSH_HOSTS, SUPERVISOR_LOG
from orchestrate.core.plan.outcome import Attempt
from orchestrate.run.store import SUPERVISOR_PATIENCE_S, Store

if TYPE_CHECKING:
    from orchestrate.core.plan.plan import Occupancy
    from orchestrate.run.prepare import Prepared


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
    from orchestrate.backends.ssh.connections import Target, preload
    from orchestrate.backends.ssh.sessions import HostPool

    handshake = json.loads(sys.stdin.readline() or "{}")
    verdict = _Verdict()
    source = str(handshake["loaded"]["source"])
    run_dir = Path(handshake["loaded"]["runs"]) / job_id
    try:
        secrets = secret_values(tuple(handshake.get("secret_env", ())), source)
    except UserError as exc:
        verdict.send({"ok": False, "problems": [asdict(p) for p in exc.problems]})
        return 2
    # Log into the hosts submit planned while this process imports and plans (the logins are
    # what costs; they need no plan). SSH first: imports hold the GIL the handshakes need.
    preload()
    pool = HostPool(int(handshake["fanout"]), secrets)
    for host in handshake.get("hosts", []):
        pool.open(Target.from_json(host["target"]), int(host["nproc"]))

    from orchestrate.backends.ssh.evidence import RemoteEvidence
    from orchestrate.backends.ssh.launcher import Cancelled, Launcher, PreflightFailed
    from orchestrate.backends.ssh.reaping import HostStopper, progress_on
    from orchestrate.core.plan.plan import Occupancy, Plan
    from orchestrate.run.logsink import LogSink
    from orchestrate.run.prepare import Loaded, plan_job
    from orchestrate.run.supervise import Launched, StopRequest, run_with_restarts

    stop = StopRequest()
    stop.install()
    store = Store(store_path, patience_s=SUPERVISOR_PATIENCE_S)
    submitted_at = float(handshake.get("submitted_at", time.time()))
    started = time.monotonic()
    _log(f"up after {time.time() - submitted_at:.2f}s (since submit started)")
    try:
        loaded = Loaded.from_json(handshake["loaded"])

        def replan(facts: Occupancy) -> Prepared:
            return plan_job(loaded, job_id, facts)

        prepared = plan_job(loaded, job_id)
        _log(f"planned in {time.monotonic() - started:.2f}s")
        launcher = Launcher(prepared, replan, pool, lambda: stop.reason, _log)
        prepared = launcher.settle()
        files = BACKEND.files(prepared.plan, prepared.templates_dir)
        launcher.copy(prepared, files)
    except PreflightFailed as failed:
        from orchestrate.backends.ssh.preflight import problems

        _log(f"preflight failed: {failed.verdict.failures}")
        pool.close(abort_all=True)
        verdict.send({
            "ok": False,
            "problems": [asdict(p) for p in problems(failed.verdict, source)],
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
            Problem(f"not launched: {exc}", source=source),)
        verdict.send({"ok": False, "problems": [asdict(p) for p in problems_]})
        return 2
    except BaseException as exc:
        _log("".join(traceback.format_exception(exc)))
        pool.close(abort_all=True)
        verdict.send({"ok": False, "problems": [asdict(Problem(
            f"the SSH launch failed: {type(exc).__name__}: {exc}", source=source,
            hint=f"details in {run_dir / SUPERVISOR_LOG}"))]})
        return 1

    plan = prepared.plan
    run_dir = write_run_dir(prepared, files)
    targets = launcher.targets(plan)
    (run_dir / SSH_HOSTS).write_text(
        json.dumps([t.to_json() for t in targets.values()], indent=2) + "\n")
    hostnames = launcher.hostnames()
    again = handshake.get("attempt")
    if again is None:
        record = new_record(prepared, "PENDING", submitted_at)
        record.supervisor_pid = os.getpid()
        record.supervisor_host = socket.gethostname()
        for rank in record.ranks:
            rank.host = hostnames.get(rank.node)
        store.add(record)
    else:  # `orchestrate resume`: the next attempt of the same job
        store.reopen(job_id, Attempt(int(again), submitted_at))
        store.update(job_id, plan=plan, hosts=[n.address for n in plan.nodes],
                     supervisor_pid=os.getpid(), supervisor_host=socket.gethostname())
        for r in plan.ranks:
            store.update_rank(job_id, r.rank, node=r.node, host=hostnames.get(r.node))
        found = store.get(job_id)
        assert found is not None
        record = found
    _log(f"launching {plan.world_size} rank(s) on {len(plan.nodes)} host(s) after "
         f"{time.monotonic() - started:.2f}s ({launcher.timings})")
    verdict.send({"ok": True, "timings": launcher.timings})

    fanout = int(handshake["fanout"])
    first_attempt = record.attempt

    def launch(attempt: int, excluded: tuple[str, ...]) -> tuple[Plan, Launched]:
        nonlocal launcher, prepared
        if attempt > first_attempt:  # a restart: plan again (a node may be excluded), relaunch
            pool = HostPool(fanout, secrets)
            facts = Occupancy(excluded=frozenset(excluded))
            prepared = plan_job(loaded, job_id, facts)
            launcher = Launcher(prepared, lambda more: plan_job(loaded, job_id, _also(more,
                                                                                     excluded)),
                                pool, lambda: stop.reason, _log)
            prepared = launcher.settle()
            files = BACKEND.files(prepared.plan, prepared.templates_dir)
            launcher.copy(prepared, files)
            write_run_dir(prepared, files)
            targets = launcher.targets(prepared.plan)
            (run_dir / SSH_HOSTS).write_text(
                json.dumps([t.to_json() for t in targets.values()], indent=2) + "\n")
            store.update(job_id, plan=prepared.plan,
                         hosts=[n.address for n in prepared.plan.nodes])
            names = launcher.hostnames()  # a rank may have moved (a node excluded)
            for r in prepared.plan.ranks:
                store.update_rank(job_id, r.rank, node=r.node, host=names.get(r.node))
        plan = prepared.plan
        sink = LogSink(run_dir, {r.rank: r.node for r in plan.ranks})

        def note(text: str) -> None:
            _log(text)
            sink.note(text)

        stopper = HostStopper(launcher.links, launcher.targets(plan), job_id, STOP_GRACE_S,
                              note=note)
        handles = launcher.handles(plan, stopper, STOP_GRACE_S, attempt)
        pool_now = launcher.pool
        for handle in handles:
            handle.prime()

        def cleanup() -> None:
            # Hosts whose agent saw nothing of the job left when a rank ended are clean
            # already; the others (a rank lost, a process left behind) get kill-by-tag.
            clean = {h.node for h in handles if h.left_host_clean}
            stopper.sweep(launcher.fanout, skip=clean)
            pool_now.close(abort_all=False)

        evidence = RemoteEvidence(plan, launcher.targets(plan), launcher.links,
                                  launcher.fanout, run_dir)
        return plan, Launched(handles, cleanup, sink, evidence)

    def progress(plan: Plan) -> dict[str, int | None]:
        return progress_on(plan, launcher.targets(plan))

    outcome = run_with_restarts(job_id, run_dir, store, plan, stop, STOP_GRACE_S, launch,
                                progress)
    return 0 if outcome.state == "COMPLETED" else 1


def _also(more: Occupancy, excluded: tuple[str, ...]) -> Occupancy:
    """What preflight found, with the nodes the restart policy excluded kept out."""
    return replace(more, excluded=more.excluded | frozenset(excluded))


if __name__ == "__main__":
    sys.exit(run_supervisor(sys.argv[1], Path(sys.argv[2])))
