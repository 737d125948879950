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

:func:`train_config` is the job's ``train:`` section and :func:`check_balanced` what the tests
check of an ``equal`` and a ``measured`` run of it (both backends' tests, and the bench's job).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset


def throttle_self(wait_s: float = 60.0) -> None:
    """Move this process into the throttling cgroup when it is the rank to slow down, and every
    other rank into the fast one (``MIXED_FAST_CGROUP``: no cap, the same high CPU weight, so
    that other work on the machine slows neither; tests/support/throttle.py). Where the cgroup
    file system cannot be seen (an SSH test host: ``ip netns exec`` mounts its own /sys), the
    test moves the rank from outside: wait until /proc/self/cgroup says so."""
    rank = os.environ.get("MIXED_THROTTLE_RANK")
    if rank is None or os.environ.get("RANK") is None:
        return
    group = os.environ.get("MIXED_THROTTLE_CGROUP" if os.environ["RANK"] == rank
                           else "MIXED_FAST_CGROUP")
    if group is not None:
        _join(group, os.environ["RANK"], wait_s)


def _join(group: str, rank: str, wait_s: float) -> None:
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


#: How far two runs on the same global batches may end apart, per parameter: summation order
#: only. Over 48 steps at lr 0.2 the tied layers amplify that order to a few 1e-3 at most
#: (measured: 1e-3, and 2.6e-3 for a resumed run whose shares moved at another step); one global
#: batch taken out of order moves the parameters by 2.3e-2 (measured in one process).
TOLERANCE = 8e-3


def train_config(split: str, **extra: Any) -> dict[str, Any]:
    """The ``train:`` section of the mixed-speed job with ``batch_split: split``."""
    return {"model": "mixedwork:build_model", "dataset": "mixedwork:build_dataset",
            "optimizer": {"name": "sgd", "lr": 0.2}, "epochs": 3, "global_batch_size": 1024,
            "batch_split": split, "batch_measure_steps": 6, "seed": 1, **extra}


def epochs_of(run_dir: Path) -> list[dict[str, Any]]:
    """The run's ``epoch`` metrics records."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "epoch"]


def epoch_ratio(equal_dir: Path, measured_dir: Path) -> float:
    """The measured run's median epoch time over the equal run's, epochs after the first (which
    holds the measuring steps): at most 0.8 is what a balanced split must show (ideal
    2 / (1 + s) for ranks s:1 apart in speed: 1/2 in the tests, whose slow rank runs at a third
    of a core; 2/3 in bench/mixed_shares.py, at half a core)."""
    equal, measured = epochs_of(equal_dir), epochs_of(measured_dir)
    return (statistics.median(e["epoch_s"] for e in measured[1:])
            / statistics.median(e["epoch_s"] for e in equal[1:]))


#: The most a measured run's epochs may take, as a share of the equal run's.
MAX_RATIO = 0.8
#: The least share rank 0 (uncapped) must end with, as a multiple of the capped rank 1's.
MIN_SKEW = 1.5


def timing_held(equal_dir: Path, measured_dir: Path) -> str | None:
    """What other work on a busy machine can move in one pair of runs (the tests run the pair
    again once before failing): None when the measured shares gave rank 0 at least
    :data:`MIN_SKEW` times rank 1's and its epochs took at most :data:`MAX_RATIO` of the equal
    split's; else what was seen."""
    fast, slow = epochs_of(measured_dir)[-1]["batch_shares"]
    ratio = epoch_ratio(equal_dir, measured_dir)
    if fast >= MIN_SKEW * slow and ratio <= MAX_RATIO:
        return None
    return (f"shares {fast}/{slow} (at least {MIN_SKEW}x wanted), measured / equal epochs "
            f"{ratio:.3f} (at most {MAX_RATIO})")


def check_balanced(equal_dir: Path, measured_dir: Path) -> tuple[int, int]:
    """What a throttled rank 1 must show: ``measured`` gives rank 0 at least 1.5x its share,
    its epochs after the first (which holds the measuring steps) take at most 0.8x the equal
    split's, and it ends with the equal run's accuracy and parameters (the same global
    batches); returns the measured shares."""
    from tests.support.checkpoints import differing_parameters, latest_state

    equal, measured = epochs_of(equal_dir), epochs_of(measured_dir)
    fast, slow = measured[-1]["batch_shares"]
    assert fast + slow == 1024 and fast >= MIN_SKEW * slow, measured[-1]
    ratio = epoch_ratio(equal_dir, measured_dir)
    assert ratio <= MAX_RATIO, (ratio, equal, measured)
    assert abs(measured[-1]["val_accuracy"] - equal[-1]["val_accuracy"]) <= 0.01
    assert measured[-1]["val_accuracy"] >= 0.5, measured[-1]  # it learns (10 classes)
    assert differing_parameters(latest_state(equal_dir), latest_state(measured_dir),
                                atol=TOLERANCE) == []
    return fast, slow
