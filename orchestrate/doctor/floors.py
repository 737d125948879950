"""Expected bandwidth: the floor a healthy interconnect reaches, from what the inventory declares.

The doctor grades a measurement against a *floor*, a figure that healthy hardware of the declared
kind reaches in public measurements, not the spec sheet's peak. A result below
:data:`WARN_BELOW` (50 %) of its floor is a warning and below :data:`FAIL_BELOW` (20 %) a failure
(docs/doctor.md and the reference notes, §1.2: 100 GbE over TCP reaching under half its line rate
is the classic "works, but slowly" case; a healthy EFA fabric reaches ~74 % per accelerator).

Three kinds of floor, in GB/s (10^9 bytes/s, the unit of nccl-tests):

- **Inside a node** (:func:`intra_node_floor`): all_reduce *busbw* of the node's ranks, from a
  table of public numbers per GPU family and ``gpu_link``. gloo on CPUs has none: it measures the
  CPUs and memory, not a link (0.52-0.95 GB/s on loopback on a 2-core VM, and it scales with how
  many ranks share the cores), so any fixed floor either fires on healthy boxes or never.
- **Between two nodes** (:func:`link_floor`): one direction of a point-to-point transfer between
  one rank on each node, which uses one NIC: ``gbps / 8 * LINK_EFFICIENCY`` of the slower end.
- **All ranks over several nodes** (:func:`inter_node_floor`): stas00's payload-free conversion,
  *per-accelerator wire rate* = busbw * (k - 1) / (n - 1) for k nodes and n ranks, against the
  node's NIC bandwidth (``gbps`` times the HCAs listed in ``network.hca``) shared by its ranks.
  Only nccl is graded: gloo reduces on the CPU, which caps it far below any modern link.

``network.gbps`` is per NIC; a node with several HCAs lists them comma-separated in
``network.hca`` (``mlx5_0,mlx5_1,...``) and gets that many times the bandwidth.

Pure: values in, values out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from orchestrate.core.spec.inventory import Node

#: Below this fraction of the floor a measurement is a warning.
WARN_BELOW = 0.5
#: Below this fraction of the floor a measurement is a failure.
FAIL_BELOW = 0.2
#: The fraction of a NIC's line rate a healthy transfer reaches. Healthy public figures range
#: from 74 % (EFA, per accelerator) over 85 % (HDR-200 all_reduce, nccl-tests #119) and 92-94 %
#: (Azure's ib_write_bw floors: 185 of 200, 375 of 400 Gb/s) to 96-98 % (32 GbE TCP with one GPU
#: per node, NCCL #209); 0.8 sits inside that range.
LINK_EFFICIENCY = 0.8

Status = Literal["pass", "warn", "fail"]


@dataclass(frozen=True)
class Floor:
    """A figure healthy hardware reaches, and where it comes from (shown to the user)."""

    GBps: float
    basis: str


# (family, link) -> (floor with at most 4 GPUs, floor with 5 or more, source). NVLink SHARP (NVLS)
# only switches on above 4 GPUs on H200 (above 5 on B200), so big NVSwitch boxes get a higher one.
_NVSWITCH: dict[str, tuple[float, float, str]] = {
    "A100": (228.0, 228.0, "Azure NHC floor for 8xA100 NVSwitch (nd96asr_v4), 228 GB/s"),
    "H100": (363.0, 460.0, "ring 363 GB/s (ml-engineering); Azure NHC floor 460 GB/s with NVLS"),
    "H200": (363.0, 460.0, "ring 363 GB/s (ml-engineering); Azure NHC floor 460 GB/s with NVLS"),
    "B200": (673.0, 838.0, "ring 673 GB/s, NVLS 838 GB/s (ml-engineering, NVLink 5)"),
}
# Two GPUs joined by NVLink (a bridge or a pair of an NVLink-pairs box).
_NVLINK_PAIR: dict[str, tuple[float, str]] = {
    "A100": (208.0, "8xA100 in NVLink pairs, ranks on one pair: 208 GB/s (nccl-tests #178)"),
    "H100": (115.0, "2xH100 PCIe with NVLink bridge: 115 GB/s (NCCL #1161)"),
    "2080": (21.0, "2xRTX 2080 Ti with NVLink bridge: 21 GB/s (nccl-tests #44)"),
}
_PCIE = Floor(
    20.0,
    "all_reduce over PCIe: 20 GB/s once an A100 ring crosses PCIe (nccl-tests #178), "
    "28-35 GB/s on RTX 5090s (NCCL #1639)",
)
_FAMILY = re.compile(r"(A100|H100|H200|B200|2080)")


def family(model: str) -> str | None:
    """The GPU family the floor tables know a model by (``"A100-80GB"`` -> ``"A100"``)."""
    found = _FAMILY.search(model.upper().replace(" ", "").replace("-", ""))
    return found.group(1) if found else None


def intra_node_floor(node: Node, gpu_models: Sequence[str], backend: str) -> Floor | None:
    """all_reduce busbw floor for ``gpu_models`` (one rank each) inside ``node``; None when no
    public number fits (CPU ranks, gpu_link none, an unknown GPU family, one rank)."""
    count = len(gpu_models)
    if count < 2 or backend != "nccl" or not node.is_gpu:
        return None
    families = {family(m) for m in gpu_models}
    known = next(iter(families)) if len(families) == 1 else None
    link = node.gpu_link
    if link == "nvswitch" and known in _NVSWITCH:
        small, big, source = _NVSWITCH[known]
        return Floor(big if count >= 5 else small, source)
    if link == "nvlink":
        if count == 2 and known in _NVLINK_PAIR:
            value, source = _NVLINK_PAIR[known]
            return Floor(value, source)
        if count > 2:
            # NVLink pairs or a partial mesh: the ring over all GPUs crosses PCIe somewhere.
            return _PCIE
        return None
    if link == "pcie":
        return _PCIE
    return None


def nic_count(node: Node) -> int:
    """NICs the node's ranks share: the HCAs listed in ``network.hca``, else one."""
    hca = node.network.hca if node.network is not None else None
    if not hca:
        return 1
    return max(1, len([h for h in hca.split(",") if h.strip()]))


def nic_GBps(node: Node) -> float | None:
    """One NIC's line rate in GB/s, when the inventory declares ``network.gbps``."""
    if node.network is None or node.network.gbps is None:
        return None
    return node.network.gbps / 8.0


def _fabric(node: Node) -> str:
    return node.network.fabric if node.network is not None else "ethernet"


def link_floor(a: Node, b: Node) -> Floor | None:
    """One direction of a point-to-point transfer between one rank on ``a`` and one on ``b``:
    the slower end's NIC, times :data:`LINK_EFFICIENCY`; None when a side declares no gbps."""
    rates = [(nic_GBps(n), n) for n in (a, b)]
    if any(rate is None for rate, _ in rates):
        return None
    rate, slower = min(rates, key=lambda pair: pair[0] or 0.0)
    assert rate is not None
    gbps = slower.network.gbps if slower.network is not None else None
    return Floor(
        rate * LINK_EFFICIENCY,
        f"{gbps:g} Gb/s {_fabric(slower)} ({slower.name}) x {LINK_EFFICIENCY:g}",
    )


def wire_rate(busbw_GBps: float, nodes: int, ranks: int) -> float:
    """Per-accelerator wire rate of a multi-node all_reduce: busbw * (k - 1) / (n - 1)
    (stas00, ml-engineering network/README.md). It undoes busbw's overstatement when part of
    the ring stays inside a node (on 2 nodes the tree algorithm reports up to 2x the wire)."""
    if nodes < 2 or ranks < 2:
        return busbw_GBps
    return busbw_GBps * (nodes - 1) / (ranks - 1)


def inter_node_floor(
    nodes: Sequence[Node], ranks_per_node: Sequence[int], backend: str
) -> Floor | None:
    """Per-accelerator wire-rate floor of an all_reduce over every rank of several nodes: the
    node whose NICs give each of its ranks the least bandwidth, times :data:`LINK_EFFICIENCY`.
    None for gloo, one node, or a node without a declared gbps."""
    if backend != "nccl" or len(nodes) < 2:
        return None
    shares: list[tuple[float, Node, int]] = []
    for node, nproc in zip(nodes, ranks_per_node, strict=True):
        rate = nic_GBps(node)
        if rate is None or nproc < 1:
            return None
        shares.append((rate * nic_count(node) / nproc, node, nproc))
    share, node, nproc = min(shares, key=lambda item: item[0])
    gbps = node.network.gbps if node.network is not None else 0.0
    return Floor(
        share * LINK_EFFICIENCY,
        f"{nic_count(node)} x {gbps:g} Gb/s {_fabric(node)} shared by {nproc} rank(s) on "
        f"{node.name}, x {LINK_EFFICIENCY:g}",
    )


def grade(measured: float, floor: float) -> Status:
    """pass, warn (below 50 % of the floor) or fail (below 20 %)."""
    if measured < FAIL_BELOW * floor:
        return "fail"
    if measured < WARN_BELOW * floor:
        return "warn"
    return "pass"
