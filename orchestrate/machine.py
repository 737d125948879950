"""This machine as an inventory, for local jobs whose file names none.

The one place the local backend's planning looks at the hardware: ``nvidia-smi`` lists GPUs in
PCI bus order (the order CUDA uses under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``); without it, the node
is CPU-only with one slot per core.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess  # noqa: TID251 - probing the local machine is this module's whole job

from orchestrate.inventory import Gpu, Inventory, Node


def probe_gpus() -> list[Gpu]:
    """GPUs by CUDA index in PCI bus order, or [] without a working nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            mib = float(parts[2]) if parts[2].replace(".", "", 1).isdigit() else 0.0
            gpus.append(Gpu(int(parts[0]), parts[1].replace(" ", "-"), round(mib * 2**20 / 1e9, 1)))
    return gpus


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
