"""The lab server of issue #20 (2x A100 + 6x A6000), which the shared-server tests and bench
stand in on machines without GPUs: its GPUs as the stand-in nvidia-smi lists them
(tests/support/fakesmi.py), its inventory node, and SSH test host h1 as that server.

One definition, so that the local and SSH tests of one user and of two users share one machine,
and no test module imports another for it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tests.support.fakesmi import fake_nvidia_smi, replay_health
from tests.support.sshcli import SshCli

#: The lab server's GPUs for :func:`fake_nvidia_smi`: (index, name, memory.total MiB).
LAB = [(0, "A100-80GB", 81920), (1, "A100-80GB", 81920),
       *[(i, "RTX-A6000", 49140) for i in range(2, 8)]]

GPU_INVENTORY_NODE = {
    "name": "h1",
    "gpus": [{"model": "A100-80GB", "memory_gb": 80, "indices": [0, 1]},
             {"model": "RTX-A6000", "memory_gb": 48, "indices": [2, 3, 4, 5, 6, 7]}],
}


def gpu_python(cli: SshCli) -> str:
    """The inventory's python for h1: a wrapper that puts a stand-in nvidia-smi on PATH (GPUs
    cannot exist here), the way site wrappers (module load, conda activate) set PATH. The
    stand-in answers in nvidia-smi's CSV format (tests/probe/fake_nvidia_smi.py)."""
    bin_dir = fake_nvidia_smi(cli.work / "fakebin", [
        *[(i, "NVIDIA A100-SXM4-80GB", 81920) for i in (0, 1)],
        *[(i, "NVIDIA RTX A6000", 49140) for i in range(2, 8)]])
    wrapper = bin_dir / "python"
    wrapper.write_text(f'#!/bin/sh\nPATH={bin_dir}:$PATH exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def sick_gpu_python(cli: SshCli, case: str) -> str:
    """As :func:`gpu_python`, with the GPUs of a recorded health case (tests/hostside/gpuhealth)
    and its kernel log on the wrapper's PATH."""
    bin_dir = replay_health(cli.work / "sickbin", case)
    wrapper = bin_dir / "python"
    wrapper.write_text(f'#!/bin/sh\nPATH={bin_dir}:$PATH exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def gpu_node(cli: SshCli) -> dict[str, Any]:
    """h1 with its GPUs and a lease book of this test's own (``lease_dir``; the default is the
    machine's /var/tmp/orchestrate/leases, which every test session on this box would share)."""
    return {**GPU_INVENTORY_NODE, "lease_dir": str(lease_book(cli).parent)}


def lease_book(cli: SshCli) -> Path:
    """h1's folder of the test's lease book."""
    return cli.work / "book" / "h1"
