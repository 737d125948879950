"""A rank's CPUs bound to its GPU's NUMA node, from inside the rank.

The planner writes ``ORCHESTRATE_CPU_BIND`` into the node's environment: one CPU list per local
rank, ``;``-separated (``0-55,112-167;0-55,112-167;56-111,168-223``), the CPUs of the NUMA node
of the GPU that local rank drives (core/plan/rankenv.py). The rank sidecar's start-up
(``sitecustomize``, in every Python process of a rank: :mod:`orchestrate.diagnosis.activation`)
calls :func:`bind_from`, which binds the process with ``os.sched_setaffinity``.

Why here and not ``taskset``/``numactl`` in the launch script: one way that works for every
launcher. Under ``launcher: torchrun``/``accelerate`` one process per node starts the workers,
so the script cannot bind each worker to another NUMA node, while each worker's own start-up
knows its ``LOCAL_RANK``; a container started through a daemon (docker) does not inherit the
script's affinity, while the sidecar runs inside it; and ``numactl`` is often missing on the
host and in images, ``sched_setaffinity`` never. The cost: a program that is not Python is not
bound (docs/shared-servers.md says so).

Only ever narrows: the CPUs bound are the NUMA node's among those the process may already use
(a Slurm or cgroup cpuset, a user's own ``taskset``); a process already inside them (a child
that inherited the binding, or narrowed itself) is left alone; none left in common: unbound.

Standard library only, Python 3.8+, and nothing from orchestrate: the sidecar folder carries a
copy of this module (:mod:`orchestrate.diagnosis.rankpackage`).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: The node's variable: each local rank's CPU list, ``;``-separated, in local-rank order.
CPU_BIND_VAR = "ORCHESTRATE_CPU_BIND"
#: Its value under Slurm: each rank finds its GPU's CPUs itself (:func:`slurm_gpu_cpus`).
SLURM_MODE = "slurm"


def cpu_set(cpus: str) -> frozenset[int]:
    """The CPUs of a CPU list as Linux writes it: ``0-2,8`` -> {0, 1, 2, 8}."""
    out: set[int] = set()
    for part in cpus.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return frozenset(out)


def wanted(environ: Any) -> frozenset[int] | None:
    """The CPUs this process's local rank is planned on, or None (no plan, no LOCAL_RANK, a
    rank beyond the list, a list that does not parse). ``slurm``: found here, by
    :func:`slurm_gpu_cpus`."""
    lists = str(environ.get(CPU_BIND_VAR, "")).strip()
    local = str(environ.get("LOCAL_RANK", "")).strip()
    if not lists or not local.isdigit():
        return None
    if lists == SLURM_MODE:
        try:
            return slurm_gpu_cpus(environ, int(local))
        except (OSError, ValueError):
            return None
    entries = lists.split(";")
    if int(local) >= len(entries):
        return None
    try:
        return cpu_set(entries[int(local)]) or None
    except ValueError:
        return None


def slurm_gpu_cpus(environ: Any, local: int) -> frozenset[int] | None:
    """Under Slurm, the CPUs beside the GPU that local rank ``local`` drives: Slurm chose the
    job's GPUs, so the plan cannot name them. ``SLURM_STEP_GPUS`` (else ``SLURM_JOB_GPUS``) holds
    their Slurm indices, which are the NVIDIA device minors (``/dev/nvidiaN``, the order Slurm
    sorts gres.conf's devices in); the driver's ``/proc/driver/nvidia/gpus/BUS/information``
    maps each minor to its PCI bus id; in PCI bus order (CUDA_DEVICE_ORDER=PCI_BUS_ID) the
    rank's is the ``local``-th; its CPUs are sysfs's ``local_cpulist`` of that device."""
    mine = slurm_gpu_buses(environ)
    if mine is None or local >= len(mine):
        return None
    sysfs = os.environ.get("ORCHESTRATE_SYSFS_ROOT") or "/sys"
    with open(os.path.join(sysfs, "bus", "pci", "devices", mine[local], "local_cpulist")) as f:
        return cpu_set(f.read()) or None


def slurm_gpu_buses(environ: Any) -> list[str] | None:
    """The PCI bus ids (``0000:c1:00.0``) of the GPUs Slurm gave this step (``SLURM_STEP_GPUS``,
    else ``SLURM_JOB_GPUS``: NVIDIA device minors), in PCI bus order, from the driver's
    ``/proc/driver/nvidia/gpus/BUS/information``; None where Slurm named none. Raises OSError
    or ValueError where the driver's files cannot be read."""
    ids = str(environ.get("SLURM_STEP_GPUS") or environ.get("SLURM_JOB_GPUS") or "").strip()
    if not ids:
        return None
    proc = os.environ.get("ORCHESTRATE_PROC_ROOT") or "/proc"
    gpus = os.path.join(proc, "driver", "nvidia", "gpus")
    bus_of = {}
    for bus in os.listdir(gpus):
        with open(os.path.join(gpus, bus, "information")) as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "Device Minor":
                    bus_of[int(value)] = bus.lower()
    return sorted(bus_of[int(i)] for i in ids.split(",") if int(i) in bus_of)


def bind_from(environ: Any) -> frozenset[int] | None:
    """Bind this process to its local rank's CPUs (see the module docstring); returns the CPUs
    it runs on when bound now, else None."""
    target = wanted(environ)
    if target is None or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = frozenset(os.sched_getaffinity(0))
    if allowed <= target:
        return None  # bound already (inherited), or narrower by the user's choice
    cpus = allowed & target
    if not cpus:
        return None
    os.sched_setaffinity(0, cpus)
    return cpus
