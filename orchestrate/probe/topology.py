"""Where a node's GPUs sit: their NUMA nodes (with those nodes' CPUs) and the GPU islands that
talk without crossing the CPU, from ``nvidia-smi topo -m`` and sysfs.

Pure, like :mod:`orchestrate.probe.facts`: the matrix's ``CPU Affinity`` and ``NUMA Affinity``
columns name each GPU's NUMA node and its CPUs; ``/sys/devices/system/node/nodeN/cpulist``
(gathered by :func:`orchestrate.hostside.hostfacts.numa_nodes`) gives every NUMA node's whole
CPU list, also of nodes without GPUs, and wins where both speak. Cells ``PIX`` (one PCIe
switch) and ``PXB`` (several switches, no host bridge) join GPUs into a PCIe-switch island,
``NV#`` into an NVLink island; an island of all the node's GPUs (an NVSwitch box) says nothing
a choice could use and is left out. What the inventory gets (``numa:``, ``gpu_islands:``) is
what the planner picks GPUs by (core/plan/gpuchoice.py) and binds ranks' CPUs to.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from orchestrate.core.spec.inventory import Island, Numa

_DEVICE = re.compile(r"GPU\d+")
_NVLINK = re.compile(r"NV\d+")


def parse_affinity(text: str) -> dict[int, tuple[str | None, int | None]]:
    """Each GPU row's ``CPU Affinity`` and ``NUMA Affinity`` by nvidia-smi index (None where
    the cell is missing or ``N/A``)."""
    width = None
    out: dict[int, tuple[str | None, int | None]] = {}
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if width is None:
            if "CPU" in words and words[0].startswith("GPU"):
                width = words.index("CPU")  # the device columns before "CPU Affinity"
            continue
        if words[0].startswith("Legend"):
            break
        if not _DEVICE.fullmatch(words[0]):
            continue
        rest = words[1 + width:]
        cpus = rest[0] if rest and rest[0][:1].isdigit() else None
        numa = int(rest[1]) if len(rest) > 1 and rest[1].isdigit() else None
        out[int(words[0][3:])] = (cpus, numa)
    return out


def numa_facts(cuda_of: Mapping[int, int], topo: str | None,
               sysfs: Mapping[str, str]) -> tuple[Numa, ...]:
    """The machine's NUMA nodes with their CPUs and GPUs (``cuda_of``: nvidia-smi index ->
    CUDA index); () with fewer than two (nothing to choose, nothing to bind)."""
    cpus: dict[int, str] = {int(k): v for k, v in sysfs.items() if str(k).isdigit() and v}
    gpus: dict[int, list[int]] = {}
    for smi, (gpu_cpus, node) in (parse_affinity(topo) if topo else {}).items():
        if node is None or smi not in cuda_of:
            continue
        gpus.setdefault(node, []).append(cuda_of[smi])
        if gpu_cpus and node not in cpus:
            cpus[node] = gpu_cpus
    nodes = sorted(set(cpus) | set(gpus))
    if len(nodes) < 2 or any(n not in cpus for n in nodes):
        return ()
    return tuple(Numa(n, cpus[n], tuple(sorted(gpus.get(n, ())))) for n in nodes)


def islands(cuda_of: Mapping[int, int], cells: Mapping[tuple[int, int], str]
            ) -> tuple[Island, ...]:
    """NVLink islands, then PCIe-switch islands, of two or more GPUs but not all of them."""
    found: list[Island] = []
    for via, joined in (("nvlink", _NVLINK.fullmatch), ("pcie-switch",
                                                        lambda c: c in ("PIX", "PXB"))):
        pairs = [(cuda_of[a], cuda_of[b]) for (a, b), cell in cells.items()
                 if a != b and a in cuda_of and b in cuda_of and joined(cell)]
        for group in _components(pairs):
            if 2 <= len(group) < len(cuda_of):
                found.append(Island(group, via))
    return tuple(found)


def _components(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, ...]]:
    """The connected groups of GPUs the pairs join, each sorted, in order of their first GPU."""
    group_of: dict[int, set[int]] = {}
    for a, b in pairs:
        merged = group_of.get(a, {a}) | group_of.get(b, {b})
        for gpu in merged:
            group_of[gpu] = merged
    unique = {tuple(sorted(g)) for g in group_of.values()}
    return sorted(unique)
