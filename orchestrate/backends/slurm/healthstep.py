"""The GPU health check of a Slurm job, run by the job itself before any of its ranks starts.

Why in the job and not at ``submit``: Slurm chooses the nodes and the GPUs only when the job
starts (maybe hours later, when the submitting shell is gone), and a GPU may go bad between two
runs of a job. So job.sbatch runs a first step of one task per allocated node,
``monitor.py health-gather DIR`` (:func:`gather_node`: the node's nvidia-smi health fields and
kernel-log Xid lines, as :mod:`orchestrate.hostside.gpuhealth` gathers them for the local and
SSH backends, and which GPUs Slurm gave the job there), then judges them on the batch host,
``monitor.py health`` (:func:`judge_nodes`, :func:`verdict`: the verdicts are
:mod:`orchestrate.core.gpuhealth`'s, the ones every backend applies). It does so at every run of
the batch script: the first, each restart inside the allocation (a new step) and each requeue.

A GPU that fails ends the run before its ranks start, its node and GPU named with the sentence
that says why, in the merged log and the run's ``REASON`` (what ``status`` and ``submit
--follow`` show), with :data:`orchestrate.core.exits.EXIT_UNHEALTHY`; with
``restart.exclude_failed_node: true`` the job is requeued without that node instead (the restart
policy's budget and ``restart.on`` apply, as to a rank's failure). Never onto the same GPU: a
restart inside the allocation would keep the node. A warning is noted and the run goes on; a
node without ``nvidia-smi`` has no GPUs to check, which is said, not failed.

Standard library only, Python 3.8+: bundled into ``monitor.py``.
"""

from __future__ import annotations

import json
import os
import socket

from orchestrate.core.exits import EXIT_UNHEALTHY
from orchestrate.core.gpuhealth import bus_key, judge
from orchestrate.core.plan.restart import Ending, Policy, decide
from orchestrate.hostside.cpubind import slurm_gpu_buses
from orchestrate.hostside.gpuhealth import gather
from orchestrate.hostside.outputlog import append_note

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: How every line of the check starts (``status`` and the view recognise the run's reason).
PREFIX = "GPU health"


def gather_node(out_dir: str) -> int:
    """On one node: gather its GPUs' health and write it to ``OUT_DIR/NODE.json`` (whole, or
    not at all), with ``job_gpus``: the bus ids of the GPUs Slurm gave the job (None: Slurm
    named none, every GPU the node shows is the job's)."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    report = gather()
    try:
        report["job_gpus"] = slurm_gpu_buses(os.environ)
    except (OSError, ValueError) as exc:
        report["job_gpus"] = None
        report["job_gpus_error"] = f"which GPUs are the job's could not be read ({exc})"
    path = os.path.join(out_dir, node + ".json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)
    return 0


def read_object(path: str) -> dict[str, Any] | None:
    """A JSON object written by another process of the job, or None (absent, torn, not an
    object): the health reports here, the stall watch's file in monitor.py."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def judge_nodes(health_dir: str, hosts: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """What the check says of each host: the lines to note (warnings, what was not checked)
    and the sick GPUs' sentences per host, in plan order."""
    notes: list[str] = []
    sick: dict[str, list[str]] = {}
    for host in hosts:
        facts = read_object(os.path.join(health_dir, host + ".json"))
        if facts is None:
            notes.append(f"{PREFIX} on {host}: no report (the check did not run there; see "
                         "the slurm-*.out file in the run directory)")
            continue
        if facts.get("status") == "missing":
            notes.append(f"{PREFIX} on {host}: no GPUs to check (no nvidia-smi)")
            continue
        mine = facts.get("job_gpus")
        if isinstance(mine, list):
            wanted = {bus_key(b) for b in mine}
            facts = dict(facts, gpus=[g for g in facts.get("gpus") or []
                                      if bus_key(g.get("pci.bus_id")) in wanted])
        health = judge(facts)
        extra = [str(facts["job_gpus_error"])] if facts.get("job_gpus_error") else []
        for line in [*extra, *health.notes, *health.warnings()]:
            notes.append(f"{PREFIX} on {host}: {line}")
        if health.sick():
            sick[host] = list(health.sick().values())
    return notes, sick


def verdict(sick: dict[str, list[str]], policy: Policy, restarts: int, pinned: bool
            ) -> tuple[str, int, float, str, str]:
    """What the batch script does: ``(GO | REQUEUE | FAILED, exit status, seconds to wait,
    nodes to exclude or "-", the reason)``."""
    if not sick:
        return "GO", 0, 0.0, "-", ""
    first = next(iter(sick))
    lines = [f"{host}: {line}" for host, found in sick.items() for line in found]
    sentence = f"{PREFIX} on {lines[0]}" + (
        f" (and {len(lines) - 1} more: {'; '.join(lines[1:])})" if len(lines) > 1 else "")
    nodes = ",".join(sick)
    if policy.exclude_failed_node and not pinned:
        decision = decide(policy, Ending("failure", sentence, None, nodes), restarts, None)
        if decision.restart:
            return ("REQUEUE", EXIT_UNHEALTHY, decision.wait_s, nodes,
                    f"{sentence}: the ranks were not started; requeuing, {decision.why}")
        return "FAILED", EXIT_UNHEALTHY, 0.0, "-", (
            f"{sentence}: the ranks were not started; {decision.why}")
    hint = ("the job names its nodes (resources.node_names), so it cannot avoid "
            f"{first}" if pinned else
            f"restart.exclude_failed_node: true requeues the job without {nodes}")
    return "FAILED", EXIT_UNHEALTHY, 0.0, "-", (
        f"{sentence}: the ranks were not started ({hint})")


def check(merged: str, health_dir: str, exit_dir: str, restarts: int, policy: Policy,
          pinned: bool, hosts: list[str]) -> str:
    """``monitor.py health``: judge every host's report, note what is said in the merged log
    (``note``), the reason in ``EXIT_DIR/REASON`` too; the verdict line for the batch script:
    ``VERDICT STATUS WAIT EXCLUDE``."""
    notes, sick = judge_nodes(health_dir, hosts)
    what, status, wait, exclude, reason = verdict(sick, policy, restarts, pinned)
    try:
        for line in [*notes, reason] if reason else notes:
            append_note(merged, line)
        if reason:
            with open(os.path.join(exit_dir, "REASON"), "w", encoding="utf-8") as f:
                f.write(reason + "\n")
    except OSError:
        pass  # the verdict stands; the batch script's own note says how the run ended
    return f"{what} {status} {wait:g} {exclude}"


__all__ = ["PREFIX", "check", "gather_node", "judge_nodes", "verdict"]
