"""The doctor's ``health`` tier: each node's GPUs judged by the GPU health check, as rows.

Each node leader gathers its GPUs' health fields and the kernel log's Xid lines
(:func:`orchestrate.hostside.gpuhealth.gather`, in the checkup's leader beside the static facts);
the verdicts are :mod:`orchestrate.core.gpuhealth`'s, the same a submit applies. A planned GPU
that fails is a failed row (a launch would have planned around it: the doctor's own job was
placed before this check ran, on Slurm by the scheduler); a sick GPU the plan does not use
warns (the job runs around it, the server needs a reboot or an admin); a GPU that is slower or
suspect warns; what could not be checked (an unreadable kernel log, fields this driver lacks)
is said in the node's passing row, never failed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from orchestrate.core.gpuhealth import FAIL, PASS, judge
from orchestrate.doctor.grading import Check, JobShape, Status

TIER = "health"


def judge_health(shape: JobShape, nodes: Mapping[str, Mapping[str, Any]]) -> list[Check]:
    """A row per GPU that is not healthy, and one per node for the rest (what was checked and
    what could not be)."""
    checks: list[Check] = []
    for node in shape.nodes:
        if not node.gpu_indices:
            continue
        report = nodes.get(node.name) or {}
        facts = report.get("gpu_health")
        if not isinstance(facts, Mapping):
            checks.append(Check(TIER, "gpus", (node.name,), "warn",
                                f"{node.name}: no GPU health report (its leader printed none)",
                                hint="see the static rows for why the leader did not report"))
            continue
        checks.extend(_node_rows(node.name, node.gpu_indices, facts))
    return checks


def _node_rows(name: str, planned: tuple[int, ...], facts: Mapping[str, Any]) -> list[Check]:
    health = judge(facts, planned)
    rows = []
    for gpu in health.gpus:
        if gpu.status == PASS:
            continue
        used = gpu.index in planned
        status: Status = "fail" if gpu.status == FAIL and used else "warn"
        prefix = "" if used or gpu.status != FAIL else "(not planned: the job runs around it) "
        rows.append(Check(TIER, f"gpu {gpu.index}", (name,), status,
                          f"{name}: {prefix}{gpu.line}", measured=gpu.status,
                          hint=gpu.findings[0].action))
    healthy = [g.index for g in health.gpus if g.status == PASS]
    notes = "; ".join(health.notes)
    if healthy or notes:
        detail = (f"{name}: GPU(s) {','.join(map(str, healthy))} healthy" if healthy
                  else f"{name}: no healthy GPU") + (f" ({notes})" if notes else "")
        rows.append(Check(TIER, "gpus", (name,), "pass" if healthy else "warn", detail,
                          measured=f"{len(healthy)} of {len(health.gpus)}"))
    return rows


__all__ = ["TIER", "judge_health"]
