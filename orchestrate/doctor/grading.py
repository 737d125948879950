"""The doctor's judgement: check records, the verdict, and the grading of what was measured.

A :class:`Check` is one row of the doctor's table and one element of ``--json``'s ``checks``:
``{"tier", "name", "nodes", "status", "detail", "measured", "expected", "hint"}`` with status
pass / warn / fail. The verdict is the worst status; the exit status is 1 when a check failed,
else 0 (a warning does not stop a job; user errors exit 2 before any check runs).

This module grades the checkup's smoke result (:mod:`orchestrate.doctor.checkup`) and the
connect tier's attempts (:mod:`orchestrate.doctor.checkup.reachability`) against the planned job
(:class:`JobShape`), and names the culprits among bad node pairs (:func:`culprits`: a slow or
unreachable *node*, every pair with it bad and the others fine, is named as the node; a bad pair
that no node explains is named as a link; healthy pairs are never blamed).
:mod:`orchestrate.doctor.static_tier` grades the static tier, :mod:`orchestrate.doctor.bandwidth`
the measured figures against :mod:`orchestrate.doctor.floors`.

Pure: values in, values out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from orchestrate.core.plan.plan import Plan
from orchestrate.core.spec.inventory import Inventory, Node
from orchestrate.doctor.checkup.result import CheckupResult

Status = Literal["pass", "warn", "fail"]
_ORDER: dict[str, int] = {"pass": 0, "warn": 1, "fail": 2}
@dataclass(frozen=True)
class Check:
    """One row: a check on some nodes, its status, and what to do about it."""

    tier: str
    name: str
    nodes: tuple[str, ...]
    status: Status
    detail: str
    measured: str | None = None
    expected: str | None = None
    hint: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "name": self.name,
            "nodes": list(self.nodes),
            "status": self.status,
            "detail": self.detail,
            "measured": self.measured,
            "expected": self.expected,
            "hint": self.hint,
        }


def worst(statuses: Iterable[Status]) -> Status:
    """The most severe status (pass when there is none)."""
    out: Status = "pass"
    for status in statuses:
        if _ORDER[status] > _ORDER[out]:
            out = status
    return out


def verdict(checks: Iterable[Check]) -> Status:
    """pass, warn or fail: the worst check."""
    return worst(c.status for c in checks)


def exit_status(checks: Iterable[Check]) -> int:
    """1 when a check failed, else 0."""
    return 1 if verdict(checks) == "fail" else 0


def document(checks: Sequence[Check], bandwidth: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``--json`` document: ``{"verdict", "checks": [...], "bandwidth": {...}}``."""
    return {
        "verdict": verdict(checks),
        "checks": [c.to_json() for c in checks],
        "bandwidth": dict(bandwidth or {}),
    }


# -- the planned job -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedNode:
    """A node of the plan with its inventory entry."""

    name: str
    node: Node
    nproc: int
    gpu_models: tuple[str, ...] = ()
    gpu_indices: tuple[int, ...] = ()
    interface: str | None = None  # GLOO_SOCKET_IFNAME the plan gives the node


@dataclass(frozen=True)
class JobShape:
    """What grading needs of a plan: its nodes (in node-rank order), backend and master."""

    nodes: tuple[PlannedNode, ...]
    backend: str
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    def planned(self, name: str) -> PlannedNode | None:
        return next((n for n in self.nodes if n.name == name), None)


def shape_of(plan: Plan, inventory: Inventory) -> JobShape:
    """The shape of ``plan``; a node missing from ``inventory`` gets bare defaults."""
    nodes = []
    for n in plan.nodes:
        entry = inventory.node(n.name) or Node(name=n.name, address=n.address)
        nodes.append(PlannedNode(
            name=n.name,
            node=entry,
            nproc=n.nproc,
            gpu_models=tuple(n.gpu_models),
            gpu_indices=tuple(n.gpu_indices),
            interface=n.env.get("GLOO_SOCKET_IFNAME"),
        ))
    return JobShape(tuple(nodes), plan.dist_backend, plan.master_addr, plan.master_port)


# -- naming bad nodes and links ------------------------------------------------------------------


def culprits(
    nodes: Sequence[str], bad: Iterable[tuple[str, str]]
) -> tuple[list[str], list[tuple[str, str]]]:
    """(nodes to blame, links to blame) from the bad node pairs.

    A node is blamed when every pair it is in is bad while some pair without it is fine (so
    with three nodes or more); a bad pair not explained by a blamed node is a bad link. When
    every pair is bad, nothing singles out a node: every pair is returned as a link. Pairs come
    back in the order of ``nodes``.
    """
    position = {n: i for i, n in enumerate(nodes)}

    def pair(a: str, b: str) -> tuple[str, str]:
        return (a, b) if position[a] < position[b] else (b, a)

    pairs = {pair(a, b) for a, b in bad if a != b and a in position and b in position}
    everyone = {(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:]}
    if len(nodes) < 3 or pairs >= everyone:
        return [], sorted(pairs, key=lambda p: (position[p[0]], position[p[1]]))
    blamed = [n for n in nodes if all(pair(n, m) in pairs for m in nodes if m != n)]
    links = [p for p in pairs if p[0] not in blamed and p[1] not in blamed]
    return blamed, sorted(links, key=lambda p: (position[p[0]], position[p[1]]))


# -- smoke ---------------------------------------------------------------------------------------


def judge_checkup(result: CheckupResult | None, shape: JobShape) -> list[Check]:
    """The smoke rows (and a bandwidth failure) of the checkup's result; ``None`` means rank
    0 wrote nothing."""
    everyone = shape.names
    if result is None:
        return [Check(
            "smoke", "checkup result", everyone, "fail",
            "the checkup wrote no result: rank 0 did not finish (see the ranks' output)",
            hint="run `orchestrate doctor --tier smoke` again and read rank 0's log",
        )]
    failure = result.failure
    expected = f"{shape.world_size} rank(s) join, pass a barrier, all_reduce correctly"
    if failure is not None and failure.tier == "smoke":
        return [Check(
            "smoke", failure.step, failure.nodes or everyone, "fail", failure.detail,
            measured="; ".join(f"rank {r}: {t}" for r, t in sorted(failure.per_rank.items())),
            expected=expected, hint=_smoke_hint(failure.step),
        )]
    steps = result.steps_s
    measured = ", ".join(f"{k} {v:.2f} s" for k, v in steps.items()
                         if k in ("join", "init", "all_reduce"))
    rows = [Check(
        "smoke", "process group", everyone, "pass",
        f"{result.world_size} rank(s) on {len(result.nodes)} node(s) joined ({result.backend}), "
        "passed a barrier and got a correct all_reduce",
        measured=measured or None, expected=expected,
    )]
    if failure is not None:
        rows.append(Check(
            "bandwidth", failure.step, failure.nodes or everyone, "fail", failure.detail,
            measured="; ".join(f"rank {r}: {t}" for r, t in sorted(failure.per_rank.items())),
            hint="a rank stopped during the measurement: " + _smoke_hint(failure.step),
        ))
    return rows


def _smoke_hint(step: str) -> str:
    if step == "join":
        return ("start the named ranks' node (is it up, is its python the inventory's?) and "
                "check that it reaches MASTER_ADDR:MASTER_PORT (run the connect tier)")
    if step in ("init", "monitored_barrier", "barrier"):
        return ("ranks reach the master but not each other: check the interface "
                "(GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME) and firewalls on ephemeral ports "
                "(run the connect tier)")
    if step == "all_reduce":
        return "a wrong or stuck all_reduce: check the named node's GPUs, drivers and NCCL"
    return "read the named ranks' output"


# -- connect -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectAttempt:
    """One TCP connection the connect tier tried
    (``orchestrate.doctor.checkup.reachability.connect``)."""

    source: str  # node that connected
    target: str  # node it connected to
    port: int
    purpose: Literal["master", "pair"]
    outcome: str  # ok | refused | timeout | unreachable | error
    seconds: float = 0.0
    detail: str = ""


@dataclass(frozen=True)
class Listening:
    """A listener the connect tier started
    (``orchestrate.doctor.checkup.reachability.Listener``)."""

    node: str
    port: int
    purpose: Literal["master", "pair"]
    error: str | None = None  # could not listen: the port is taken, or no permission
    heard: tuple[str, ...] = field(default_factory=tuple)  # names that said hello


_OUTCOME_HINT = {
    "refused": "nothing listened, or a firewall REJECTs the port: open it on the target",
    "timeout": "no answer within the bound: a firewall DROPs the port on the target or on "
               "the way",
    "unreachable": "no route to the target: check the address and the interface's routes",
}


def judge_connect(
    shape: JobShape, listeners: Sequence[Listening], attempts: Sequence[ConnectAttempt]
) -> list[Check]:
    """Rows for the master port (every node -> the master's listener) and the ephemeral ports
    between nodes (every ordered pair)."""
    rows: list[Check] = []
    for lst in listeners:
        if lst.error:
            what = "MASTER_PORT" if lst.purpose == "master" else "an ephemeral port"
            rows.append(Check(
                "connect", f"listen on {lst.node}", (lst.node,), "fail",
                f"could not listen on {what} {lst.port or ''} on {lst.node}: {lst.error}",
                hint="choose another distributed.master_port (or 'auto')"
                if lst.purpose == "master" else "check the node's local port range and limits",
            ))
    master = [a for a in attempts if a.purpose == "master"]
    bad_master = [a for a in master if a.outcome != "ok"]
    for a in bad_master:
        rows.append(Check(
            "connect", "master port", (a.source,), "fail",
            f"{a.source} cannot connect to the master {a.target}:{a.port}: {a.outcome}"
            + (f" ({a.detail})" if a.detail else ""),
            measured=a.outcome, expected="connected within 3 s",
            hint=_OUTCOME_HINT.get(a.outcome, "see the detail"),
        ))
    good_master = [a for a in master if a.outcome == "ok"]
    if good_master:
        slowest = max(a.seconds for a in good_master)
        rows.append(Check(
            "connect", "master port", tuple(a.source for a in good_master), "pass",
            f"{len(good_master)} of {len(master)} node(s) reach {good_master[0].target}:"
            f"{good_master[0].port}", measured=f"slowest {slowest * 1000:.0f} ms",
            expected="connected within 3 s",
        ))
    rows.extend(_judge_pair_ports(shape, [a for a in attempts if a.purpose == "pair"]))
    return rows


def _judge_pair_ports(shape: JobShape, attempts: Sequence[ConnectAttempt]) -> list[Check]:
    if not attempts:
        return []
    names = [n for n in shape.names if any(n in (a.source, a.target) for a in attempts)]
    failed = [a for a in attempts if a.outcome != "ok"]
    blamed, links = culprits(names, [(a.source, a.target) for a in failed])
    rows: list[Check] = []
    for node in blamed:
        inbound = [a for a in failed if a.target == node]
        outbound = [a for a in failed if a.source == node]
        peers = len(names) - 1
        if len(inbound) >= peers and len(outbound) < peers:
            direction = f"no other node can connect to {node}"
            hint = f"a firewall on {node} blocks incoming connections on ephemeral ports"
        elif len(outbound) >= peers and len(inbound) < peers:
            direction = f"{node} cannot connect to any other node"
            hint = f"a firewall on {node} blocks outgoing connections"
        else:
            direction = f"{node} and the other nodes cannot connect either way"
            hint = f"check {node}'s network, address and firewall"
        example = (inbound or outbound)[0]
        rows.append(Check(
            "connect", f"node {node}", (node,), "fail",
            f"{direction} on ephemeral ports (gloo and NCCL listen there), e.g. "
            f"{example.source} -> {example.target}:{example.port}: {example.outcome}",
            measured=f"{len(inbound)} in, {len(outbound)} out failed",
            expected="every node reaches every other", hint=hint,
        ))
    for a_name, b_name in links:
        bad = [a for a in failed if {a.source, a.target} == {a_name, b_name}]
        rows.append(Check(
            "connect", f"link {a_name} <-> {b_name}", (a_name, b_name), "fail",
            "; ".join(f"{a.source} -> {a.target}:{a.port}: {a.outcome}" for a in bad),
            measured=", ".join(a.outcome for a in bad), expected="connected within 3 s",
            hint=_OUTCOME_HINT.get(bad[0].outcome, "see the detail"),
        ))
    good = [a for a in attempts if a.outcome == "ok"]
    if good:
        rows.append(Check(
            "connect", "node-to-node ports", tuple(names), "pass",
            f"{len(good)} of {len(attempts)} node-to-node connection(s) on ephemeral ports "
            "succeeded", measured=f"slowest {max(a.seconds for a in good) * 1000:.0f} ms",
            expected="connected within 3 s",
        ))
    return rows
