"""A compute-bound job for the mixed-speed tests and bench/mixed_shares.py, and the throttle that
makes one of its ranks a slow GPU.

On GPUs a training step is compute: the per-sample work dominates, and a GPU half as fast takes
twice as long per sample. A small model on CPUs is not like that (the optimizer and the
collectives are most of a step), so the stand-in is an MLP whose hidden layer is applied eight
times (weights tied) on a large synthetic set: 0.3 M parameters (1.2 MB to all-reduce a step: on
CPUs the all-reduce is CPU work too, which a throttled rank does at its throttled speed, unlike a
GPU's NCCL), a few MFLOP per sample, a step of about 100 ms per 512 samples on one core, of which
the optimizer (SGD) is about 1%.

The slow GPU is a rank in a cgroup whose CPU bandwidth is capped (cgroup v1
``cpu.cfs_quota_us``, v2 ``cpu.max``): the dataset factory runs in the rank's process before any
of its threads exist, and when ``MIXED_THROTTLE_RANK`` names its rank it moves itself into the
cgroup ``MIXED_THROTTLE_CGROUP`` (the test made it; it runs as root), or waits to be moved
(:func:`throttle_self`). Used as
``mixedwork:build_model`` and ``mixedwork:build_dataset`` with this folder as the job's workdir.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset


def throttle_self(wait_s: float = 60.0) -> None:
    """Move this process into the throttling cgroup when it is the rank to slow down. Where the
    cgroup file system cannot be seen (an SSH test host: ``ip netns exec`` mounts its own
    /sys), the test moves the rank from outside: wait until /proc/self/cgroup says so."""
    rank = os.environ.get("MIXED_THROTTLE_RANK")
    group = os.environ.get("MIXED_THROTTLE_CGROUP")
    if rank is None or group is None or os.environ.get("RANK") != rank:
        return
    if Path(group).is_dir():
        (Path(group) / "cgroup.procs").write_text(f"{os.getpid()}\n")
        return
    deadline = time.monotonic() + wait_s
    while Path(group).name not in Path("/proc/self/cgroup").read_text():
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank} was not moved into cgroup {group} in {wait_s} s")
        time.sleep(0.05)


def build_dataset(samples: int = 16384, features: int = 64, classes: int = 10,
                  seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Gaussian inputs labelled by a random linear teacher (learnable, so validation accuracy
    tells a broken run from a working one); a twentieth as many validation samples (validation
    is a fixed cost per epoch that no split changes: kept small, the epoch time is training)."""
    throttle_self()
    generator = torch.Generator().manual_seed(seed)
    val = samples // 20
    inputs = torch.randn(samples + val, features, generator=generator)
    teacher = torch.randn(features, classes, generator=generator)
    labels = (inputs @ teacher).argmax(dim=1)
    return (TensorDataset(inputs[:samples], labels[:samples]),
            TensorDataset(inputs[samples:], labels[samples:]))


class Tied(nn.Module):
    """An MLP whose hidden layer is applied ``repeats`` times (residually, so that it learns):
    compute per sample grows with ``repeats``, the parameters, which the all-reduce moves every
    step, do not."""

    def __init__(self, features: int, hidden: int, classes: int, repeats: int) -> None:
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.hidden = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)
        self.repeats = repeats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        for _ in range(self.repeats):
            x = x + torch.relu(self.hidden(x)) / self.repeats  # scaled: stable at any depth
        out: torch.Tensor = self.out(x)
        return out


def build_model(features: int = 64, hidden: int = 512, classes: int = 10,
                repeats: int = 8) -> nn.Module:
    return Tied(features, hidden, classes, repeats)
