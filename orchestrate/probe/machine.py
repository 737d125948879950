"""This machine as an inventory, for local jobs whose file names none.

The one place the local backend's planning looks at the hardware, and it looks the way
``orchestrate inventory probe --local`` does: :func:`orchestrate.hostside.hostfacts.gather`
collects (bounded ``nvidia-smi`` query and ``topo -m``, sysfs; torch is not looked for, so
planning imports and starts nothing heavy), :func:`orchestrate.probe.facts.parse_facts`
reads it, and :func:`orchestrate.probe.inventoryfile.probed_fields` builds the node, the same
fields ``probe --local`` writes. So a local job planned without an inventory, the file
``probe --local`` writes and the doctor's static tier agree by construction: GPU models
normalised (``NVIDIA H100 80GB HBM3`` -> ``H100-80GB``), memory as the probe rounds it (81,559
MiB -> 80 GB), ``gpu_link`` from the topology (``nvswitch`` on an NVSwitch box, so the doctor
grades it against that floor), CPUs this process may run on.

One difference, on purpose: the node has no ``network``. A local job's ranks meet at
127.0.0.1; the interface towards other nodes that ``probe`` records is not theirs, and naming
it would pin GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME off the loopback for every local job.

Without a working ``nvidia-smi`` the node is CPU-only with one slot per usable CPU. What is
found is an inventory *spec*, like a file's, so a job planned on it can be planned again later
(``orchestrate resume``) from what was recorded.
"""

from __future__ import annotations

import socket
from typing import Any

from orchestrate.core.spec.inventory import Gpu, Inventory, InventorySpec, resolve_inventory
from orchestrate.hostside import hostfacts
from orchestrate.probe.facts import ProbedHost, parse_facts, parse_gpu_query
from orchestrate.probe.inventoryfile import probed_fields

#: The node name and address of this machine, in local plans and in ``probe --local`` files.
LOCAL_NAME, LOCAL_ADDRESS = "localhost", "127.0.0.1"


def gather_local(peers: tuple[str, ...] = (), torch: bool = True,
                 import_torch: bool = False) -> dict[str, Any]:
    """This machine's raw facts, gathered in this process (``probe --local``, and ``check``
    for an inventory's nodes on this machine)."""
    return hostfacts.gather(peers, torch=torch, import_torch=import_torch)


def local_facts() -> ProbedHost:
    """This machine's facts, gathered and parsed as ``inventory probe --local`` does (without
    looking for torch, which planning does not need)."""
    return parse_facts(gather_local(torch=False))


def probe_gpus() -> list[Gpu]:
    """GPUs by CUDA index (PCI bus order), as the probe names them; [] without a working
    nvidia-smi. Asks only the GPU query (no topology, no network): the local backend's check
    that the plan's GPUs exist."""
    smi = hostfacts.nvidia_smi(topo=False)
    if smi["status"] != "ok":
        return []
    return [Gpu(g.cuda_index, g.model, g.memory_gb)
            for g in parse_gpu_query(smi["query"] or "", smi["fields"])]


def node_fields(facts: ProbedHost) -> dict[str, Any]:
    """The inventory entry of this machine: what ``probe --local`` writes, less the network
    (see the module docstring)."""
    fields = {k: v for k, v in probed_fields(facts).items() if k != "network"}
    return {"name": LOCAL_NAME, "address": LOCAL_ADDRESS, **fields}


def local_inventory_spec() -> InventorySpec:
    """An inventory of exactly this machine, as a spec."""
    return InventorySpec.model_validate(
        {"name": f"this machine ({socket.gethostname()})", "nodes": [node_fields(local_facts())]})


def local_inventory() -> Inventory:
    """An inventory of exactly this machine."""
    return resolve_inventory(local_inventory_spec())
