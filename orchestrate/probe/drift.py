"""Drift: where the machines no longer match their inventory.

:func:`drift` compares a resolved :class:`~orchestrate.core.spec.inventory.Inventory` with fresh
facts per node (and the provenance comments the file kept from its last probe) and returns one
:class:`Difference` per mismatch, each a sentence naming the node and the field: a GPU missing
or of another model, memory that differs, a NIC slower than declared or down, a PCIe link
narrower than it can be (or slower while the GPU works: an idle GPU's link drops its generation
to save power, which is not a fault), a driver or torch that changed since the probe.
Pure: values in, values out; ``inventory check`` and the doctor print them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from orchestrate.core.spec.inventory import Inventory, Node
from orchestrate.probe.facts import GpuFact, ProbedHost
from orchestrate.probe.network import NicFact
from orchestrate.probe.provenance import Provenance, provenance


@dataclass(frozen=True)
class Difference:
    """One way a node differs from its inventory entry."""

    node: str
    field: str
    message: str
    declared: str | None = None
    found: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The difference as JSON for ``--json``."""
        return asdict(self)


def drift(
    inventory: Inventory,
    facts: Mapping[str, ProbedHost],
    provenances: Mapping[str, Provenance] | None = None,
    unreachable: Mapping[str, str] | None = None,
) -> list[Difference]:
    """Every difference between the inventory's nodes and their facts, node by node.

    ``facts`` maps node names to what was found there; ``unreachable`` maps the nodes that could
    not be probed to why. Nodes in neither are not checked."""
    provenances = provenances or {}
    unreachable = unreachable or {}
    out: list[Difference] = []
    for node in inventory.nodes:
        if node.name in unreachable:
            out.append(Difference(node.name, "host",
                                  f"{node.name}: could not be probed: {unreachable[node.name]}"))
            continue
        found = facts.get(node.name)
        if found is None:
            continue
        out.extend(node_drift(node, found, provenances.get(node.name)))
    return out


def node_drift(node: Node, facts: ProbedHost, prov: Provenance | None = None) -> list[Difference]:
    """The differences of one node."""
    out = _gpus(node, facts)
    out += _link(node, facts)
    out += _numa(node, facts)
    out += _network(node, facts)
    if node.cpus and facts.cpus and node.cpus != facts.cpus:
        out.append(_diff(node, "cpus", f"{facts.cpus} usable CPUs, the inventory says {node.cpus}",
                         node.cpus, facts.cpus))
    if prov is not None:
        out += _provenance(node, facts, prov)
    return out


def _diff(node: Node, field: str, text: str, declared: object = None,
          found: object = None) -> Difference:
    return Difference(node.name, field, f"{node.name}: {field}: {text}", _text(declared),
                      _text(found))


def _text(value: object) -> str | None:
    if value is None:
        return None
    return f"{value:g}" if isinstance(value, float) else str(value)


def _gpus(node: Node, facts: ProbedHost) -> list[Difference]:
    out: list[Difference] = []
    if facts.gpu_status == "failed":
        return [_diff(node, "gpus", f"nvidia-smi failed: {facts.gpu_error}")]
    present: dict[int, GpuFact] = {g.cuda_index: g for g in facts.gpus}
    listed = f"{len(facts.gpus)} GPU(s)" if facts.gpus else "no GPU"
    if node.gpus and facts.gpu_status == "missing":
        return [_diff(node, "gpus", f"{len(node.gpus)} GPU(s) declared, but the host has no "
                      f"nvidia-smi ({facts.gpu_error})", len(node.gpus), 0)]
    for gpu in node.gpus:
        have = present.get(gpu.index)
        if have is None:
            out.append(_diff(node, "gpus", f"GPU {gpu.index} ({gpu.model}, {gpu.memory_gb:g} GB) "
                             f"is declared but not found; nvidia-smi lists {listed}",
                             gpu.model, None))
            continue
        if have.model != gpu.model:
            out.append(_diff(node, "gpus", f"GPU {gpu.index} is {have.model} ({have.name}), the "
                             f"inventory says {gpu.model}", gpu.model, have.model))
        elif abs(have.memory_gb - gpu.memory_gb) >= 1:
            out.append(_diff(node, "gpus", f"GPU {gpu.index} ({gpu.model}) has "
                             f"{have.memory_gb:g} GB, the inventory says {gpu.memory_gb:g} GB",
                             gpu.memory_gb, have.memory_gb))
    declared = {g.index for g in node.gpus}
    for index, have in sorted(present.items()):
        if index not in declared:
            out.append(_diff(node, "gpus", f"GPU {index} ({have.model}, {have.memory_gb:g} GB) "
                             "is not in the inventory", None, have.model))
    for have in facts.gpus:
        out += _pcie(node, have)
    return out


def _pcie(node: Node, gpu: GpuFact) -> list[Difference]:
    out = []
    if gpu.pcie_width_max and gpu.pcie_width_current and gpu.pcie_width_current < \
            gpu.pcie_width_max:
        out.append(_diff(node, "pcie", f"GPU {gpu.cuda_index}'s PCIe link runs at "
                         f"x{gpu.pcie_width_current} of x{gpu.pcie_width_max} (reseat the card, "
                         "or check the slot)", f"x{gpu.pcie_width_max}",
                         f"x{gpu.pcie_width_current}"))
    busy = gpu.utilization is not None and gpu.utilization > 0
    if busy and gpu.pcie_gen_max and gpu.pcie_gen_current and gpu.pcie_gen_current < \
            gpu.pcie_gen_max:
        out.append(_diff(node, "pcie", f"GPU {gpu.cuda_index}'s PCIe link runs at Gen"
                         f"{gpu.pcie_gen_current} of Gen{gpu.pcie_gen_max} while the GPU works "
                         f"({gpu.utilization:g}% busy)", f"Gen{gpu.pcie_gen_max}",
                         f"Gen{gpu.pcie_gen_current}"))
    return out


def _link(node: Node, facts: ProbedHost) -> list[Difference]:
    if not node.gpus or not facts.gpus or node.gpu_link == facts.link.link:
        return []
    return [_diff(node, "gpu_link", f"the GPUs are linked by {facts.link.link} "
                  f"({facts.link.detail}), the inventory says {node.gpu_link}",
                  node.gpu_link, facts.link.link)]


def _numa(node: Node, facts: ProbedHost) -> list[Difference]:
    """A GPU on another NUMA node, a NUMA node with other CPUs, or NUMA nodes gone (what the
    planner places and binds ranks by: docs/shared-servers.md)."""
    if not node.numa or not facts.gpus:
        return []
    if not facts.numa:
        return [_diff(node, "numa", f"fewer than two NUMA nodes found, the inventory lists "
                      f"{len(node.numa)}")]
    out: list[Difference] = []
    found = {n.node: n for n in facts.numa}
    for numa in node.numa:
        there = found.get(numa.node)
        if there is not None and there.cpus != numa.cpus:
            out.append(_diff(node, "numa", f"NUMA node {numa.node} has CPUs {there.cpus}, the "
                             f"inventory says {numa.cpus}", numa.cpus, there.cpus))
    on = {g: n.node for n in facts.numa for g in n.gpus}
    for gpu in node.gpus:
        declared, actual = node.numa_of(gpu.index), on.get(gpu.index)
        if declared is not None and actual is not None and declared.node != actual:
            out.append(_diff(node, "numa", f"GPU {gpu.index} is on NUMA node {actual}, the "
                             f"inventory says {declared.node}", declared.node, actual))
    return out


def _network(node: Node, facts: ProbedHost) -> list[Difference]:
    net = node.network
    if net is None:
        return []
    out: list[Difference] = []
    nic = facts.nic(net.interface) if net.interface else None
    if net.interface:
        if nic is None:
            return [_diff(node, "network.interface", f"{net.interface} does not exist on "
                          f"{facts.hostname} (it has "
                          f"{', '.join(n.name for n in facts.nics) or 'no interface'})",
                          net.interface, None)]
        if not nic.up:
            out.append(_diff(node, "network.interface", f"{net.interface} is down (operstate "
                             f"{nic.operstate})", "up", nic.operstate))
    ib_ports = [p for p in facts.hcas if (p.link_layer or "").lower() == "infiniband"]
    if net.hca:
        for hca in [h.strip().split(":")[0] for h in net.hca.split(",") if h.strip()]:
            ports = [p for p in facts.hcas if p.hca == hca]
            if not ports:
                out.append(_diff(node, "network.hca", f"HCA {hca} not found", hca, None))
            elif not any(p.active for p in ports):
                states = ", ".join(f"port {p.port} {p.state}" for p in ports)
                out.append(_diff(node, "network.hca", f"HCA {hca} has no active port ({states})",
                                 "ACTIVE", states))
    if net.fabric == "infiniband" and not any(p.active for p in ib_ports):
        out.append(_diff(node, "network.fabric", "declared infiniband, but no InfiniBand port "
                         "is active", "infiniband", facts.network.fabric if facts.network
                         else None))
    if net.gbps:
        speed, what = _speed(net.fabric, net.hca, nic, facts)
        if speed is not None and speed < net.gbps:
            out.append(_diff(node, "network.gbps", f"{what} runs at {speed:g} Gb/s, the "
                             f"inventory says {net.gbps:g} Gb/s", net.gbps, speed))
    return out


def _speed(fabric: str, hca: str | None, nic: NicFact | None,
           facts: ProbedHost) -> tuple[float | None, str]:
    """The measured speed of what the inventory declares: the HCA ports' rate for InfiniBand,
    else the interface's link speed."""
    if fabric == "infiniband" or (fabric == "roce" and hca):
        names = [h.strip().split(":")[0] for h in (hca or "").split(",") if h.strip()]
        ports = [p for p in facts.hcas if p.active and p.gbps and (not names or p.hca in names)]
        if ports:
            slowest = min(ports, key=lambda p: p.gbps or 0)
            return slowest.gbps, f"{slowest.hca} port {slowest.port}"
    if nic is not None and nic.speed_mbps:
        return nic.speed_mbps / 1000, nic.name
    return None, ""


def _provenance(node: Node, facts: ProbedHost, prov: Provenance) -> list[Difference]:
    now = provenance(facts)
    out = []
    if prov.driver and now.driver != prov.driver and facts.gpu_status == "ok":
        out.append(_diff(node, "driver", f"NVIDIA driver {now.driver}, probed with "
                         f"{prov.driver} ({prov.when})", prov.driver, now.driver))
    # The version alone: "(CUDA 12.8, NCCL 2.27.5)" depends on how torch was looked at.
    if prov.torch and now.torch and now.torch.split()[0] != prov.torch.split()[0]:
        out.append(_diff(node, "torch", f"torch {now.torch}, probed with {prov.torch} "
                         f"({prov.when})", prov.torch, now.torch))
    if prov.pcie and now.topology and now.pcie != prov.pcie:
        out.append(_diff(node, "pcie", f"the GPUs' links can do {now.pcie or 'nothing known'} "
                         f"now, {prov.pcie} when probed ({prov.when})", prov.pcie, now.pcie))
    return out
