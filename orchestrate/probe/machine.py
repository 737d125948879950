"""This machine as an inventory, for local jobs whose file names none.

The one place the local backend's planning looks at the hardware: ``nvidia-smi`` lists GPUs in
PCI bus order (the order CUDA uses under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``); without it, the node
is CPU-only with one slot per core. The probe itself is :func:`orchestrate.hostside.host.gpus`, the
same one the SSH agent runs on remote hosts. What it finds is an inventory *spec*, like a file's, so
a
job planned on it can be planned again later (``orchestrate resume``) from what was recorded.
"""

from __future__ import annotations

import os
import socket

from orchestrate.core.spec.inventory import Gpu, Inventory, InventorySpec, resolve_inventory
from orchestrate.hostside import host


def probe_gpus() -> list[Gpu]:
    """GPUs by CUDA index in PCI bus order, or [] without a working nvidia-smi."""
    found = host.gpus()
    if not found.get("ok"):
        return []
    return [
        Gpu(int(index), str(name).replace(" ", "-"), round(float(mib) * 2**20 / 1e9, 1))
        for index, name, mib in found["present"]
    ]


def local_inventory_spec() -> InventorySpec:
    """An inventory of exactly this machine, as a spec."""
    gpus = probe_gpus()
    cpus = os.cpu_count() or 1
    node: dict[str, object] = {"name": "localhost", "address": "127.0.0.1", "cpus": cpus}
    if gpus:
        models = list(dict.fromkeys(g.model for g in gpus))
        node["gpus"] = [
            {"model": model, "memory_gb": next(g.memory_gb for g in gpus if g.model == model),
             "indices": [g.index for g in gpus if g.model == model]}
            for model in models
        ]
        node["gpu_link"] = "pcie"
    else:
        node["slots"] = cpus
        node["gpu_link"] = "none"
    return InventorySpec.model_validate(
        {"name": f"this machine ({socket.gethostname()})", "nodes": [node]})


def local_inventory() -> Inventory:
    """An inventory of exactly this machine."""
    return resolve_inventory(local_inventory_spec())
