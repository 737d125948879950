"""Grading what the checkup measured: the all_reduce sweeps and the node-pair matrix.

Each figure is graded against its floor (:mod:`orchestrate.doctor.floors`: what healthy
hardware of the inventory's kind reaches): below 50 % warns, below 20 % fails; a figure without
a public floor is reported, not graded (a node pair without a declared ``network.gbps`` is
compared with the best pair instead). The node pairs are graded first, then blamed
(:func:`orchestrate.doctor.grading.culprits`): a node every pair of which is slow while other
pairs are fine is named as the node; a slow pair no node explains as the link; healthy pairs
are summarised in one passing row. The section returned is the ``bandwidth`` part of
``doctor.json`` (the figures with each chart's expected band), which the page draws.

Pure: values in, values out.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrate.doctor import floors
from orchestrate.doctor.checkup.result import CheckupResult, PairMatrix, SizeTiming, Sweep
from orchestrate.doctor.grading import Check, JobShape, PlannedNode, Status, culprits, worst

#: Without a declared floor, a node pair below this fraction of the best pair is a warning.
RELATIVE_BELOW = 0.25

HINT_NODE_LINK = (
    "check that node's NIC (ethtool <interface>: speed, errors), cable and switch port, and "
    "that GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME name its fast interface"
)
HINT_TCP = (
    "NCCL over TCP sockets often stays under half of a fast Ethernet link (NCCL #450): try "
    "NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4, or RDMA (RoCE/InfiniBand)"
)
HINT_INTRA = (
    "check `nvidia-smi topo -m` (NVLink where the inventory says nvlink/nvswitch), GPU clocks "
    "and throttling, and that NCCL_P2P_DISABLE is not set"
)



def _gb(value: float) -> str:
    return f"{value:.3g} GB/s"


def _size(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def _band(floor: floors.Floor | None, scale: float = 1.0) -> dict[str, Any] | None:
    if floor is None:
        return None
    value = floor.GBps * scale
    return {
        "floor_GBps": round(value, 4),
        "warn_below_GBps": round(value * floors.WARN_BELOW, 4),
        "fail_below_GBps": round(value * floors.FAIL_BELOW, 4),
        "basis": floor.basis,
    }


def _graded(
    name: str, nodes: tuple[str, ...], measured: float, shown: str, floor: floors.Floor | None,
    unknown: str, hint: str,
) -> Check:
    if floor is None:
        return Check("bandwidth", name, nodes, "pass", f"{shown}; not graded: {unknown}",
                     measured=_gb(measured))
    status = floors.grade(measured, floor.GBps)
    share = measured / floor.GBps if floor.GBps > 0 else 0.0
    detail = f"{shown}: {share:.0%} of the floor"
    if status != "pass":
        detail += f" (warn below {floors.WARN_BELOW:.0%}, fail below {floors.FAIL_BELOW:.0%})"
    return Check("bandwidth", name, nodes, status, detail, measured=_gb(measured),
                 expected=f">= {_gb(floor.GBps)} ({floor.basis})",
                 hint=hint if status != "pass" else "")


def _why_no_floor(shape: JobShape, nodes: Sequence[PlannedNode], inter: bool) -> str:
    if shape.backend != "nccl":
        return ("gloo reduces on the CPUs, which bound it before the link (0.5-0.95 GB/s on "
                "loopback here); the node pairs measure the links")
    if inter:
        return "the inventory declares no network.gbps for " + ", ".join(
            n.name for n in nodes if floors.nic_GBps(n.node) is None)
    return "no public figure for this GPU model and gpu_link"


def judge_bandwidth(
    result: CheckupResult, shape: JobShape
) -> tuple[list[Check], dict[str, Any]]:
    """Rows for the all_reduce sweeps and the node pairs, and the ``bandwidth`` section of the
    doctor's JSON (the measured figures with each chart's expected band)."""
    rows: list[Check] = []
    section: dict[str, Any] = {"backend": result.backend}
    planned = planned_by_name(result.nodes, shape)
    used = [planned[n] for n in result.nodes if n in planned]
    if result.world is not None and (best := result.world.best()) is not None:
        rows_, section["all_reduce"] = _judge_world(result.world, best, used, shape)
        rows.extend(rows_)
    section["intra_node"] = {}
    for name, sweep in result.intra.items():
        node = planned.get(name)
        best = sweep.best()
        if node is None or best is None:
            continue
        floor = floors.intra_node_floor(node.node, node.gpu_models, shape.backend)
        rows.append(_graded(
            "all_reduce inside " + name, (name,), best.busbw_GBps,
            f"busbw {_gb(best.busbw_GBps)} at {_size(best.bytes)} over {sweep.ranks} ranks",
            floor, _why_no_floor(shape, [node], inter=False), HINT_INTRA,
        ))
        section["intra_node"][name] = {**sweep.to_json(), "expected": _band(floor)}
    if result.pairs is not None:
        rows_, section["pairs"] = _judge_pairs(result.pairs, planned)
        rows.extend(rows_)
    return rows, section


def planned_by_name(names: Sequence[str], shape: JobShape) -> dict[str, PlannedNode]:
    """The planned node behind each node name of a checkup result: by name, or by position
    when the ranks did not know the names (``node <GROUP_RANK>``, ORCHESTRATE_NODE_NAMES
    unset) and the counts agree."""
    by_name = {n.name: n for n in shape.nodes}
    if all(name in by_name for name in names) or len(names) != len(shape.nodes):
        return by_name
    return dict(zip(names, shape.nodes, strict=True))


def _judge_world(
    sweep: Sweep, best: SizeTiming, used: Sequence[PlannedNode], shape: JobShape
) -> tuple[list[Check], dict[str, Any]]:
    names = tuple(n.name for n in used)
    if sweep.nodes < 2:
        node = used[0] if used else None
        floor = None if node is None else floors.intra_node_floor(
            node.node, node.gpu_models, shape.backend)
        row = _graded(
            "all_reduce", names, best.busbw_GBps,
            f"busbw {_gb(best.busbw_GBps)} at {_size(best.bytes)} over {sweep.ranks} rank(s)",
            floor, "one rank: nothing crosses a link" if sweep.ranks < 2 else
            _why_no_floor(shape, used, inter=False), HINT_INTRA,
        )
        return [row], {**sweep.to_json(), "expected": _band(floor)}
    floor = floors.inter_node_floor([n.node for n in used], [n.nproc for n in used],
                                    shape.backend)
    wire = floors.wire_rate(best.busbw_GBps, sweep.nodes, sweep.ranks)
    fabric = {n.node.network.fabric for n in used if n.node.network is not None}
    row = _graded(
        "all_reduce across nodes", names, wire,
        f"busbw {_gb(best.busbw_GBps)} at {_size(best.bytes)} over {sweep.ranks} ranks on "
        f"{sweep.nodes} nodes = {_gb(wire)} per rank on the wire (busbw x (k-1)/(n-1))",
        floor, _why_no_floor(shape, used, inter=True),
        HINT_TCP if fabric <= {"ethernet"} else HINT_NODE_LINK,
    )
    # The chart plots busbw: scale the per-rank wire floor back into busbw.
    scale = (sweep.ranks - 1) / (sweep.nodes - 1)
    return [row], {**sweep.to_json(), "expected": _band(floor, scale)}


@dataclass(frozen=True)
class _PairGrades:
    """The node-pair matrix graded: each pair's slower direction, its floor and status."""

    pairs: PairMatrix
    rates: dict[tuple[str, str], float | None]
    floor_of: dict[tuple[str, str], floors.Floor | None]
    status: dict[tuple[str, str], Status]
    best: float

    @property
    def names(self) -> tuple[str, ...]:
        return self.pairs.nodes

    def rate(self, a: str, b: str) -> float | None:
        """What ``a`` sent to ``b``, in GB/s."""
        index = self.names.index
        return self.pairs.GBps[index(a)][index(b)]

    def directions(self, a: str, b: str) -> str:
        ab, ba = self.rate(a, b), self.rate(b, a)
        return (f"{a}->{b} {'-' if ab is None else _gb(ab)}, "
                f"{b}->{a} {'-' if ba is None else _gb(ba)}")

    def expected(self, keys: Iterable[tuple[str, str]]) -> str | None:
        found = [f for f in (self.floor_of[k] for k in keys) if f is not None]
        if not found:
            return f"within {1 / RELATIVE_BELOW:g}x of the best pair ({_gb(self.best)})"
        low = min(found, key=lambda f: f.GBps)
        return f">= {_gb(low.GBps)} ({low.basis})"


def _grade_pairs(pairs: PairMatrix, planned: Mapping[str, PlannedNode]) -> _PairGrades:
    """Every pair against its floor (the slower end's NIC), else against the best pair."""
    names = pairs.nodes
    rates: dict[tuple[str, str], float | None] = {}
    floor_of: dict[tuple[str, str], floors.Floor | None] = {}
    for i, a_name in enumerate(names):
        for j in range(i + 1, len(names)):
            key = (a_name, names[j])
            rates[key] = pairs.rate(i, j)
            a, b = planned.get(a_name), planned.get(names[j])
            floor_of[key] = None if a is None or b is None else floors.link_floor(a.node, b.node)
    best = max(_known(rates.values()), default=0.0)
    status: dict[tuple[str, str], Status] = {}
    for key, rate in rates.items():
        floor = floor_of[key]
        if rate is None:
            status[key] = "fail"
        elif floor is not None:
            status[key] = floors.grade(rate, floor.GBps)
        else:
            status[key] = "warn" if rate < RELATIVE_BELOW * best else "pass"
    return _PairGrades(pairs, rates, floor_of, status, best)


def _node_row(g: _PairGrades, node: str, healthy: Sequence[tuple[str, str]]) -> Check:
    """A node every pair of which is slow: named, with how fast it sends and receives."""
    keys = [k for k in g.rates if node in k]
    values = _known(g.rates[k] for k in keys)
    others = _known(g.rates[k] for k in healthy)
    peers = [n for n in g.names if n != node]
    sends = _known(g.rate(node, p) for p in peers)
    receives = _known(g.rate(p, node) for p in peers)
    detail = (
        f"every pair with {node} is slow ({len(keys)} of {len(keys)}): {node} sends at "
        + (f"{_gb(min(sends))}" if sends else "-")
        + ", receives at " + (f"{_gb(min(receives))}" if receives else "-")
        + " (slowest peer); "
        + "; ".join(g.directions(*sorted(k, key=lambda n: n != node)) for k in keys)
    )
    if others:
        detail += f"; the other pairs reach {_gb(statistics.median(others))} (median)"
    return Check(
        "bandwidth", f"node {node}", (node,), worst(g.status[k] for k in keys), detail,
        measured=_gb(min(values)) if values else "not measured",
        expected=g.expected(keys), hint=HINT_NODE_LINK,
    )


def _link_row(g: _PairGrades, key: tuple[str, str]) -> Check:
    """A slow (or unmeasured) pair that no node explains."""
    rate = g.rates[key]
    detail = ("slow link: " if rate is not None else "not measured: ") + g.directions(*key)
    if len(g.names) == 2:
        detail += " (with two nodes the doctor cannot tell which end is slow)"
    return Check(
        "bandwidth", f"link {key[0]} <-> {key[1]}", key, g.status[key], detail,
        measured=None if rate is None else _gb(rate), expected=g.expected([key]),
        hint=HINT_NODE_LINK,
    )


def _judge_pairs(
    pairs: PairMatrix, planned: Mapping[str, PlannedNode]
) -> tuple[list[Check], dict[str, Any]]:
    """Grade the matrix, then blame: slow nodes, then slow links no node explains, then one
    row for the healthy pairs; and the matrix section with each pair's band."""
    g = _grade_pairs(pairs, planned)
    names, count = g.names, len(g.names)
    blamed, links = culprits(names, [k for k, s in g.status.items() if s != "pass"])
    healthy = [k for k, s in g.status.items() if s == "pass"]
    rows = [_node_row(g, node, healthy) for node in blamed]
    rows.extend(_link_row(g, key) for key in links)
    if healthy:
        values = _known(g.rates[k] for k in healthy)
        rows.append(Check(
            "bandwidth", "node pairs", tuple(names), "pass",
            f"{len(healthy)} of {len(g.rates)} node pair(s) healthy, {_size(pairs.bytes)} per "
            f"transfer: {_gb(min(values))} to {_gb(max(values))} (slower direction)",
            measured=_gb(statistics.median(values)) + " median", expected=g.expected(healthy),
        ))
    matrix_floor = [
        [None if i == j else _band(g.floor_of[(names[min(i, j)], names[max(i, j)])])
         for j in range(count)] for i in range(count)
    ]
    section = {**pairs.to_json(), "expected": matrix_floor,
               "blamed_nodes": blamed, "blamed_links": [list(k) for k in links]}
    return rows, section


def _known(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


__all__ = ["judge_bandwidth", "planned_by_name"]
