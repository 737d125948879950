"""Random number generator state: seeding, and saving it so a resumed run repeats itself.

A resumed run must end with the same parameters as one that never stopped. Dropout masks and
in-process augmentations come from the python, numpy and torch generators, so a checkpoint keeps
each rank's states and a resume puts them back. The states are stored as plain lists and tensors
so checkpoints load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:  # numpy is optional: seed and save it only where it is installed
    import numpy
except ImportError:  # pragma: no cover - numpy ships with every torch wheel we support
    numpy = None  # type: ignore[assignment]

RngState = dict[str, Any]


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch (all CUDA devices too) with ``seed``."""
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """The training-time seed of a rank: distinct per rank, so ranks draw different dropout
    masks, and fixed by ``seed``, so a rerun draws the same ones."""
    return (seed * 1_000_003 + rank * 7_919 + 1) % 2**63


def capture(cuda: bool) -> RngState:
    """This process's generator states."""
    state: RngState = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
        state["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore(state: RngState) -> None:
    """Put back states from :func:`capture` (those missing in ``state`` are left alone)."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state and numpy is not None:
        name, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state(
            (name, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached)
        )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
