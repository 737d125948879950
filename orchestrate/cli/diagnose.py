"""``orchestrate diagnose JOB``: what every rank of a job is doing, and who it waits for.

It asks every rank of a running job for its stacks and flight recorder (the rank sidecar
answers within about a second; a frozen rank does not, and that silence is its answer), reads
their heartbeats, and prints one row per rank: node, pid, phase, step, the last collective of
each process group with its state, the heartbeat's age, the innermost frame of the user's code.
When no rank has progressed for ``distributed.stall_s`` it classifies the stall in one sentence,
as the supervisor's stall watch does. A job that ended shows what it left (its last heartbeats
and the diagnosis the watch made, if any). Every wait is bounded: it answers in seconds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from orchestrate.cli import completion
from orchestrate.cli.tables import console
from orchestrate.core.layout import SSH_HOSTS
from orchestrate.core.spec.backendtraits import traits
from orchestrate.diagnosis.evidence import Collection, read_diagnosis, read_heartbeats
from orchestrate.diagnosis.hangwatch import Evidence, RunDirEvidence
from orchestrate.diagnosis.ranktable import idle_s, rank_table
from orchestrate.diagnosis.stall import Diagnosis, classify

if TYPE_CHECKING:  # the store imports the planner: loaded when the command runs
    from orchestrate.run.store import JobRecord

def _source(job: JobRecord) -> tuple[Evidence, Any]:
    """Where this job's evidence is, and what to close afterwards."""
    run_dir = Path(job.run_dir)
    ranks = [r.rank for r in job.plan.ranks]
    if not traits(job.backend).files_on_hosts:
        return RunDirEvidence(run_dir, ranks), None
    # Read on each host (SSH, the one backend whose hosts keep their own run directories).
    from orchestrate.backends.ssh.connections import Links, Target
    from orchestrate.backends.ssh.evidence import RemoteEvidence

    hosts = json.loads((run_dir / SSH_HOSTS).read_text(encoding="utf-8"))
    targets = {t["name"]: Target.from_json(t) for t in hosts}
    links = Links()
    return RemoteEvidence(job.plan, targets, links, job.plan.ssh.fanout, run_dir), links


def look(job: JobRecord, timeout_s: float) -> dict[str, Any]:
    """Every rank's state now (asked, if the job runs), and the stall's classification."""
    plan = job.plan
    run_dir = Path(job.run_dir)
    nodes = {r.rank: (r.host or r.node) for r in job.ranks}
    master = f"{plan.master_addr}:{plan.master_port}"
    interface = plan.nodes[0].env.get("GLOO_SOCKET_IFNAME") if plan.nodes else None
    collected: Collection | None = None
    running = not job.terminal and job.state not in ("PENDING", "SUBMITTING")
    problem = None
    if running:
        closer = None
        try:
            source, closer = _source(job)
            collected = source.collect(timeout_s)
            beats = source.heartbeats()
        except Exception as exc:  # unreachable hosts, a missing run dir: say so, show the rest
            problem = f"could not ask the ranks: {type(exc).__name__}: {exc}"
            beats = read_heartbeats(run_dir, [r.rank for r in job.ranks])
        finally:
            if closer is not None:
                closer.close()
    else:
        beats = read_heartbeats(run_dir, [r.rank for r in job.ranks])
    now = time.time()
    dumps = None if collected is None else collected.answers
    rows = rank_table(beats, dumps, now, nodes)
    idle = idle_s(beats)
    stalled = running and idle is not None and plan.stall_s > 0 and idle >= plan.stall_s
    diagnosis: Diagnosis | None = None
    if running and (stalled or (collected is not None and collected.silent)) and \
            any(beat is not None for beat in beats.values()):
        diagnosis = classify(beats, dumps, now, nodes, master, interface)
    kept = job.diagnosis or _as_json(read_diagnosis(run_dir))
    return {
        "job": job.id,
        "state": job.state,
        "running": running,
        "idle_s": idle,
        "stall_s": plan.stall_s,
        "stalled": bool(stalled),
        "diagnosis": _as_json(diagnosis),
        "watch_diagnosis": kept,
        "ranks": [row.to_json() for row in rows],
        "collected": None if collected is None else {
            "id": collected.id, "dir": collected.dir, "silent": collected.silent,
            "waited_s": collected.waited_s},
        "problem": problem,
    }


def _as_json(diagnosis: Diagnosis | None) -> dict[str, Any] | None:
    return None if diagnosis is None else diagnosis.to_json()


@click.command()
@click.argument("job_ref", metavar="JOB", required=False, shell_complete=completion.jobs)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0.5, 60), default=4.0,
              show_default=True, help="seconds to wait for the ranks' answers")
def diagnose(job_ref: str | None, as_json: bool, timeout_s: float) -> None:
    """Every rank's phase, step, collectives and frame; who a stalled job waits for."""
    from orchestrate.backends import get_backend
    from orchestrate.cli.jobs import resolve_or_latest
    from orchestrate.run.store import Store

    store = Store()
    job = resolve_or_latest(store, job_ref)
    job = get_backend(job.backend).refresh(job, store)
    found = look(job, timeout_s)
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    _print(found)


def _print(found: dict[str, Any]) -> None:
    from rich.table import Table

    out = console()
    idle = found["idle_s"]
    head = f"job {found['job']}: {found['state']}"
    if idle is not None:
        head += f"; last progress {idle:.0f} s ago (stall bound {found['stall_s']:g} s)"
    out.print(head, markup=False)
    if found["problem"]:
        out.print(found["problem"], markup=False)
    table = Table()
    for column in ("rank", "node", "pid", "phase", "step", "collectives", "heartbeat",
                   "where (user code)"):
        table.add_column(column)
    for row in found["ranks"]:
        age = row["heartbeat_age_s"]
        beat = "-" if age is None else f"{age:.0f} s ago"
        if row["answered"] is False:
            beat += " (silent)"
        table.add_row(str(row["rank"]), row["node"] or "-", str(row["pid"] or "-"),
                      row["phase"] or "-", "-" if row["step"] is None else str(row["step"]),
                      "\n".join(row["collectives"]) or "-", beat,
                      (row["frame"] or "-") + (f" ({row['kernel']})" if row["kernel"] else ""))
    out.print(table)
    if found["diagnosis"]:
        out.print(f"stalled ({found['diagnosis']['kind']}): {found['diagnosis']['summary']}",
                  markup=False)
    elif found["running"]:
        out.print("not stalled" + ("" if idle is None else
                                   f": some rank progressed {idle:.0f} s ago"), markup=False)
    kept = found["watch_diagnosis"]
    if kept and (not found["diagnosis"] or kept.get("summary") != found["diagnosis"]["summary"]):
        when = time.strftime("%H:%M:%S", time.localtime(float(kept.get("at") or 0)))
        out.print(f"the stall watch said at {when} ({kept.get('kind')}): {kept.get('summary')}",
                  markup=False)
    if found["collected"]:
        out.print(f"stacks and flight recorders: {found['collected']['dir']}", markup=False)
