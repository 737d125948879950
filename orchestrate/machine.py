"""This machine as an inventory, for local jobs whose file names none.

The one place the local backend's planning looks at the hardware: ``nvidia-smi`` lists GPUs in
PCI bus order (the order CUDA uses under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``); without it, the node
is CPU-only with one slot per core. The probe itself is :func:`orchestrate.host.gpus`, the same
one the SSH agent runs on remote hosts.
"""

from __future__ import annotations

import os
import socket

from orchestrate import host
from orchestrate.inventory import Gpu, Inventory, Node


def probe_gpus() -> list[Gpu]:
    """GPUs by CUDA index in PCI bus order, or [] without a working nvidia-smi."""
    found = host.gpus()
    if not found.get("ok"):
        return []
    return [
        Gpu(int(index), str(name).replace(" ", "-"), round(float(mib) * 2**20 / 1e9, 1))
        for index, name, mib in found["present"]
    ]


def local_inventory() -> Inventory:
    """An inventory of exactly this machine."""
    gpus = probe_gpus()
    cpus = os.cpu_count() or 1
    node = Node(
        name="localhost",
        address="127.0.0.1",
        gpus=tuple(gpus),
        slots=None if gpus else cpus,
        gpu_link="pcie" if gpus else "none",
        cpus=cpus,
    )
    return Inventory(name=f"this machine ({socket.gethostname()})", nodes=(node,), source="")
