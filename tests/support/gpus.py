"""The GPU tier's gate: how many CUDA GPUs this machine's torch sees, asked once in a child
process (the test process itself never initialises CUDA), and the skip that says why.

A machine without an NVIDIA device node has no GPU for torch either, and is told so without the
child's ``import torch`` (seconds, at the collection of every run, ``-m unit`` too)."""

from __future__ import annotations

import glob
import subprocess
import sys

import pytest


def _count() -> int:
    if not glob.glob("/dev/nvidia[0-9]*") and not glob.glob("/dev/dxg"):
        return 0
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count() "
         "if torch.cuda.is_available() else 0)"], capture_output=True, text=True, timeout=120)
    return int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0


GPUS = _count()


def needs_gpu(why: str) -> pytest.MarkDecorator:
    """Skip, with the reason, where there is no GPU; ``why`` says what needs one."""
    return pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU (torch.cuda.is_available() is "
                              f"False): {why}")
