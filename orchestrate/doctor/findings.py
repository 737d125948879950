"""From what a doctor job left behind to the doctor's checks: one function, :func:`assess`.

The doctor (:mod:`orchestrate.doctor.run`) runs the checkup as a job through the job's own backend,
then hands this module what came back: the marked lines of every rank's output
(:mod:`orchestrate.doctor.checkup.transcript`: each node leader's static and connect report, rank
0's result, a lone rank's own failure) and how the job ended (:class:`JobEnd`: completed, failed
with the backend's reason and first failing rank, refused before launch, or cut off at the
doctor's deadline). Grading proper is :mod:`orchestrate.doctor.static_tier` (static) and
:mod:`orchestrate.doctor.grading` (connect, smoke, bandwidth); what this module adds is turning the
reports into their inputs, and naming what is *missing*: a node whose leader never reported, a
pair that could not be tested, a checkup that wrote no result, each as a failed check naming
the node and the backend's reason, never as a silent pass.

Pure: values in, values out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from orchestrate.core.errors import Problem
from orchestrate.core.spec.inventory import Inventory
from orchestrate.doctor.bandwidth import judge_bandwidth
from orchestrate.doctor.checkup.options import TIERS
from orchestrate.doctor.checkup.result import CheckupFailure, CheckupResult
from orchestrate.doctor.grading import (
    Check,
    ConnectAttempt,
    JobShape,
    Listening,
    PlannedNode,
    judge_checkup,
    judge_connect,
)
from orchestrate.doctor.health_tier import judge_health
from orchestrate.doctor.static_tier import NodeFacts, from_host, judge_static


def tiers_up_to(tier: str) -> tuple[str, ...]:
    """The tiers a ``--tier`` runs: each tier includes the ones before it (static, connect,
    smoke, bandwidth); ``all`` is every tier."""
    if tier == "all":
        return TIERS
    return TIERS[: TIERS.index(tier) + 1]


@dataclass(frozen=True)
class JobEnd:
    """How the doctor's job ended, as the backend and the doctor saw it.

    ``state``: the job's final state (COMPLETED, FAILED, CANCELLED, TIMEOUT), or REFUSED (the
    backend would not launch it: ``refused`` holds its problems), or DEADLINE (the doctor's own
    bound passed and it cancelled the job; ``reason`` says in which state).
    """

    state: str
    reason: str = ""
    failed_rank: int | None = None
    failed_node: str | None = None
    last_lines: tuple[str, ...] = ()
    refused: tuple[Problem, ...] = ()

    @property
    def why(self) -> str:
        """One sentence for checks that lack a report."""
        if self.state == "DEADLINE":
            text = self.reason or "the doctor's deadline passed"
        else:
            text = f"the doctor's job ended {self.state}"
            if self.reason:
                text += f": {self.reason}"
        if self.failed_rank is not None and self.failed_node and self.failed_node not in text:
            text += f" (first failure: rank {self.failed_rank} on {self.failed_node})"
        last = [line.strip() for line in self.last_lines if line.strip()]
        if last:
            text += f"; its last line: {last[-1][:300]}"
        return text


def by_kind(payloads: Iterable[Mapping[str, Any]], kind: str) -> list[Mapping[str, Any]]:
    """The marked payloads of one kind."""
    return [p for p in payloads if p.get("kind") == kind]


def ran_on(shape: JobShape, inventory: Inventory,
           payloads: Sequence[Mapping[str, Any]]) -> JobShape:
    """The shape of the nodes the job really ran on.

    Where a backend chooses the hosts (Slurm places a job where it has room, not where the plan
    guessed), the reports name other nodes than the plan: each report's node takes the place of
    the plan's node of the same GROUP_RANK, graded against its own inventory entry when the
    inventory has one (else the planned node's)."""
    names: dict[int, str] = {}
    for p in payloads:
        group = p.get("group_rank")
        if p.get("kind") == "node" and isinstance(group, int):
            names[group] = str(p.get("node"))
        for r in p.get("ranks") or []:
            if isinstance(r, Mapping) and isinstance(r.get("group_rank"), int):
                names.setdefault(int(r["group_rank"]), str(r.get("node")))
    planned = {n.name for n in shape.nodes}
    if not names or all(n in planned or n.startswith("node ") for n in names.values()):
        return shape
    nodes: list[PlannedNode] = []
    for i, node in enumerate(shape.nodes):
        actual = names.get(i)
        if actual is None or actual == node.name or actual.startswith("node "):
            nodes.append(node)
            continue
        entry = inventory.node(actual) or node.node
        nodes.append(replace(node, name=actual, node=entry))
    return replace(shape, nodes=tuple(nodes))


def assess(
    shape: JobShape,
    tiers: Sequence[str],
    payloads: Sequence[Mapping[str, Any]],
    end: JobEnd,
) -> tuple[list[Check], dict[str, Any]]:
    """Every check of the doctor's run, and the ``bandwidth`` section of its document."""
    if end.state == "REFUSED":
        return _refused(shape, end), {}
    checks: list[Check] = []
    nodes = {str(p.get("node")): p for p in by_kind(payloads, "node")}
    if "static" in tiers:
        checks.extend(_static(shape, nodes, end))
    if "health" in tiers:
        checks.extend(judge_health(shape, nodes))
    if "connect" in tiers:
        checks.extend(_connect(shape, nodes, end))
    bandwidth: dict[str, Any] = {}
    if "smoke" in tiers or "bandwidth" in tiers:
        result = _result(payloads)
        if result is None:
            checks.append(_no_result(shape, end))
        else:
            checks.extend(judge_checkup(result, shape))
            if "bandwidth" in tiers and result.failure is None:
                rows, bandwidth = judge_bandwidth(result, shape)
                checks.extend(rows)
                bandwidth = report_bandwidth(bandwidth)
            if result.ok and end.state != "COMPLETED":
                checks.append(_ended(shape, end, tiers))
    return _first_causes(checks), bandwidth


def _first_causes(checks: list[Check]) -> list[Check]:
    """A rank that fails to join or initialise is often the *victim* (rank 0 cannot reach a
    peer that listens on the wrong interface): when the static or connect tier failed on some
    nodes, the smoke failures point there first."""
    causes = list(dict.fromkeys(n for c in checks if c.status == "fail"
                                and c.tier in ("static", "connect") for n in c.nodes))
    if not causes:
        return checks
    first = (f"the static/connect tiers failed on {', '.join(causes)}: fix that first "
             "(a rank that cannot reach a peer is named here, the peer's fault is named there)")
    return [replace(c, hint=f"{first}; then {c.hint}" if c.hint else first)
            if c.status == "fail" and c.tier in ("smoke", "bandwidth") else c for c in checks]


def report_bandwidth(section: Mapping[str, Any]) -> dict[str, Any]:
    """The bandwidth section with the flat series the run report draws
    (:mod:`orchestrate.report.runfiles`: ``allreduce`` rows, ``expected``, ``pairs``)."""
    out = dict(section)
    rows: list[dict[str, Any]] = []
    backend = str(section.get("backend") or "")
    world = section.get("all_reduce")
    if isinstance(world, Mapping):
        label = f"all {world.get('ranks')} ranks ({backend})"
        rows += [{"size_bytes": s["bytes"], "busbw_GBps": s["busbw_GBps"],
                  "algbw_GBps": s["algbw_GBps"], "backend": label} for s in world["sizes"]]
        if world.get("expected"):
            out["expected"] = world["expected"]
    for name, sweep in (section.get("intra_node") or {}).items():
        rows += [{"size_bytes": s["bytes"], "busbw_GBps": s["busbw_GBps"],
                  "algbw_GBps": s["algbw_GBps"], "backend": f"inside {name} ({backend})"}
                 for s in sweep["sizes"]]
    out["allreduce"] = rows
    return out


# -- static ---------------------------------------------------------------------------------------


def _stopped_by_another(shape: JobShape, end: JobEnd, name: str) -> Check | None:
    """A node that did not report because the job stopped when *another* node's rank failed
    first (e.g. that host's python cannot import orchestrate): a warning naming the cause, not
    a failure of this node; the failed node's own rows name it."""
    culprit = end.failed_node
    if end.state != "FAILED" or culprit is None or culprit == name or culprit not in shape.names:
        return None
    return Check("static", "facts", (name,), "warn",
                 f"not checked: the doctor's job stopped when rank {end.failed_rank} on "
                 f"{culprit} failed first",
                 hint=f"fix {culprit} first (its rows say what failed), then run the doctor again")


def _static(shape: JobShape, nodes: Mapping[str, Mapping[str, Any]], end: JobEnd) -> list[Check]:
    facts: dict[str, NodeFacts] = {}
    victims: list[Check] = []
    for node in shape.nodes:
        report = nodes.get(node.name)
        victim = _stopped_by_another(shape, end, node.name) if report is None else None
        if victim is not None:
            victims.append(victim)
            continue
        if report is None:
            facts[node.name] = NodeFacts(versions={}, error=f"its leader printed no report "
                                         f"({end.why})")
            continue
        raw = report.get("facts")
        if not isinstance(raw, Mapping):
            facts[node.name] = NodeFacts(versions={}, error=str(
                report.get("facts_error") or "its leader gathered no facts"))
            continue
        roll = report.get("rollcall") or {}
        # Node 0 is the clocks' reference: its own offset measures nothing.
        offset = roll.get("clock_offset_s") if isinstance(roll, Mapping) else None
        if report.get("group_rank") == 0:
            offset = None
        facts[node.name] = from_host(
            raw,
            interface=report.get("interface") or node.interface,
            master_addr=str(report.get("master_addr") or shape.master_addr),
            clock_offset_s=offset,
        )
    if victims:  # the rest are graded among themselves
        shape = replace(shape, nodes=tuple(n for n in shape.nodes if n.name in facts))
    return victims + judge_static(shape, facts)


# -- connect --------------------------------------------------------------------------------------


def _connect(shape: JobShape, nodes: Mapping[str, Mapping[str, Any]], end: JobEnd
             ) -> list[Check]:
    master = shape.nodes[0].name if shape.nodes else "node 0"
    port = shape.master_port
    for report in nodes.values():
        if report.get("group_rank") == 0:
            master = str(report.get("node"))
        if report.get("master_port"):
            port = int(report["master_port"])
    listeners: list[Listening] = []
    attempts: list[ConnectAttempt] = []
    rows: list[Check] = []
    for name, report in nodes.items():
        heard = report.get("master_listener") or {}
        if heard.get("error"):
            listeners.append(Listening(name, port, "master", str(heard["error"])))
        pair = report.get("pair_listener") or {}
        if pair.get("error"):
            listeners.append(Listening(name, 0, "pair", str(pair["error"])))
        roll = report.get("rollcall") or {}
        if roll:
            attempts.append(ConnectAttempt(
                name, master, int(roll.get("port") or port), "master", str(roll.get("outcome")),
                float(roll.get("seconds") or 0), str(roll.get("detail") or "")))
        for item in report.get("pairs") or []:
            attempts.append(ConnectAttempt(
                name, str(item["target"]), int(item["port"]), "pair", str(item["outcome"]),
                float(item.get("seconds") or 0), str(item.get("detail") or "")))
    rows.extend(judge_connect(shape, listeners, attempts))
    # A node that got no directory back could not test its pairs, and no one knew its port.
    untested = [n.name for n in shape.nodes
                if len(shape.nodes) > 1 and n.name in nodes and not nodes[n.name].get("directory")]
    for name in untested:
        rows.append(Check(
            "connect", f"pairs with {name}", (name,), "fail",
            f"the node-to-node ports of {name} were not tested: it got no answer from the roll "
            f"call on {master}:{port} ({(nodes[name].get('rollcall') or {}).get('detail')})",
            hint="make the master port reachable first (see the master port row)",
        ))
    for node in shape.nodes:
        if node.name not in nodes and _stopped_by_another(shape, end, node.name) is None:
            rows.append(Check(
                "connect", "node report", (node.name,), "fail",
                f"{node.name} did not report: {end.why}",
                hint="read the node's rank logs (orchestrate logs JOB --rank R)",
            ))
    return rows


# -- smoke and bandwidth --------------------------------------------------------------------------


def _result(payloads: Sequence[Mapping[str, Any]]) -> CheckupResult | None:
    """Rank 0's result, else the first lone failure a rank printed."""
    found = by_kind(payloads, "result")
    if found:
        return CheckupResult.from_json(found[-1])
    lone = [p for p in by_kind(payloads, "rank") if p.get("failure")]
    if not lone:
        return None
    first = CheckupResult.from_json(lone[0])
    if len(lone) == 1 or first.failure is None:
        return first
    failures = [CheckupFailure.from_json(p["failure"]) for p in lone]
    ranks = tuple(sorted({r for f in failures for r in f.ranks}))
    merged = CheckupFailure(
        tier=failures[0].tier, step=failures[0].step,
        detail="; ".join(dict.fromkeys(f.detail for f in failures)),
        ranks=ranks, nodes=tuple(dict.fromkeys(n for f in failures for n in f.nodes)),
        per_rank={r: t for f in failures for r, t in f.per_rank.items()},
    )
    return replace(first, failure=merged)


def _no_result(shape: JobShape, end: JobEnd) -> Check:
    nodes = (end.failed_node,) if end.failed_node in shape.names else shape.names
    return Check(
        "smoke", "checkup result", nodes, "fail",
        f"no checkup result came back from rank 0: {end.why}",
        expected=f"{shape.world_size} rank(s) join, pass a barrier, all_reduce correctly",
        hint="read the named rank's log (orchestrate logs JOB --rank R); is orchestrate "
             "installed for the node's python?",
    )


def _ended(shape: JobShape, end: JobEnd, tiers: Sequence[str]) -> Check:
    """The checkup passed, but its job did not end cleanly (a rank's teardown, the deadline)."""
    return Check(
        tiers[-1] if tiers else "smoke", "doctor job",
        (end.failed_node,) if end.failed_node in shape.names else shape.names, "warn",
        f"the checkup passed, but {end.why}",
        hint="run the doctor again; if it recurs, read the job's logs",
    )


# -- a launch the backend refused -----------------------------------------------------------------


def _refused(shape: JobShape, end: JobEnd) -> list[Check]:
    rows: list[Check] = []
    for problem in end.refused:
        named = tuple(n for n in shape.names
                      if re.search(rf"(^|[\s(:,'\"]){re.escape(n)}($|[\s):,'\"])",
                                   problem.message))
        rows.append(Check(
            "static", "launch", named or shape.names, "fail",
            f"the {end.reason or 'backend'} would not launch the checkup: "
            + problem.render().split("\n")[0],
            hint=problem.hint or "fix what is named, then run the doctor again",
        ))
    if not rows:
        rows.append(Check("static", "launch", shape.names, "fail",
                          f"the backend would not launch the checkup: {end.why}"))
    return rows
