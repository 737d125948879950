"""The GPU tier's gate: how many CUDA GPUs this machine's torch sees, asked once in a child
process (the test process itself never initialises CUDA), and the skip that says why."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _count() -> int:
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count() "
         "if torch.cuda.is_available() else 0)"], capture_output=True, text=True, timeout=120)
    return int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0


GPUS = _count()


def needs_gpu(why: str) -> pytest.MarkDecorator:
    """Skip, with the reason, where there is no GPU; ``why`` says what needs one."""
    return pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU (torch.cuda.is_available() is "
                              f"False): {why}")
