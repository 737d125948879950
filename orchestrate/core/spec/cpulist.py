"""Linux CPU lists (``0-55,112-167``): what sysfs ``cpulist``, ``nvidia-smi topo -m``'s ``CPU
Affinity`` and ``taskset -c`` write, and what an inventory's ``numa:`` entries hold.

Its own module, free of pydantic: the planner counts a NUMA node's CPUs for OMP_NUM_THREADS
(core/plan/rankenv.py), and planning values load without the spec models (docs/performance.md).
The ranks' side parses the same text with :func:`orchestrate.hostside.cpubind.cpu_set`.
"""

from __future__ import annotations

import re

#: A CPU list as Linux writes it.
CPULIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def cpu_set(cpus: str) -> frozenset[int]:
    """The CPUs of a CPU list: ``0-2,8`` -> {0, 1, 2, 8}."""
    out: set[int] = set()
    for part in cpus.split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return frozenset(out)
