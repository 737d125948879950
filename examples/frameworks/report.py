"""One JSON line per rank: what the framework believes next to what orchestrate set.

Shared by the three probes in this folder. The ``process`` part answers "did the framework
start processes of its own?": a rank that spawned workers has children, and a worker's parent
would be another rank instead of orchestrate's launcher (the local supervisor, the SSH agent, or
``bash job.sbatch --task`` under Slurm).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

#: The torchrun contract orchestrate sets, and the variables the frameworks pick their mode by.
ENV_KEYS = (
    "RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_CPU", "SLURM_PROCID", "SLURM_LOCALID",
    "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES",
)


def lightning_args() -> dict[str, int]:
    """The devices and num_nodes to give Lightning under orchestrate (docs/frameworks.md)."""
    devices = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = os.environ.get("SLURM_NNODES") or str(int(os.environ["WORLD_SIZE"]) // devices)
    return {"devices": devices, "num_nodes": int(nodes)}


def timeout_s() -> float:
    """The job's distributed.timeout_s, for the framework's process group."""
    return float(os.environ.get("ORCHESTRATE_TIMEOUT_S", "600"))


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _children() -> list[int]:
    found: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(found)


def report(probe: str, believes: dict[str, Any], checks: dict[str, Any]) -> None:
    """Print the rank's line: ``probe {...}`` (one line, flushed)."""
    record = {
        "probe": probe,
        "believes": believes,
        "env": {key: os.environ.get(key) for key in ENV_KEYS},
        "checks": checks,
        "process": {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "parent": [arg[:100] for arg in _cmdline(os.getppid())[:6]],
            "children": _children(),
        },
    }
    print("probe " + json.dumps(record, sort_keys=True), flush=True)


def end_process_group() -> None:
    """Destroy the process group, as a program should end; call it once ``main`` has returned.

    Left to the interpreter's exit, gloo's threads can be torn down still running
    (std::terminate: SIGABRT after the probe had reported). Destroyed while the DDP model
    lives (inside ``main``, where the framework still holds it), the group's last owner becomes
    the model's reducer: its release then joins gloo's threads holding the GIL while one of them
    waits for it (pytorch/pytorch#56297), and the rank hangs at its end. Once ``main``'s
    locals are gone, the group is released from Python, which lets the GIL go first.
    """
    import gc

    import torch.distributed

    gc.collect()  # main's objects in reference cycles (frameworks keep some) go first too
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
