"""User code for the tests: the digits example, instrumented the way a curious user would do it.

The factories delegate to ``examples/digits/digits.py`` and, when asked, record what each rank
really did (the weights at its first forward and at exit, the sample indices it read), slow the
data down, or fail on one rank. Nothing here reaches into orchestrate.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path
from typing import Any

import digits
import torch
from torch.utils.data import Dataset, Subset


def _rank() -> int:
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def build_model(
    record_dir: str | None = None, fail_on_rank: int | None = None, **kwargs: Any
) -> torch.nn.Module:
    """digits.build_model; optionally saves the weights seen at the first forward and at exit."""
    rank = _rank()
    if fail_on_rank == rank:
        raise ValueError(f"no model for rank {rank} (a test asked this rank to fail)")
    model = digits.build_model(**kwargs)
    if record_dir is not None:
        out = Path(record_dir)
        seen = {"first": False}

        def first_forward(module: torch.nn.Module, args: Any) -> None:
            if not seen["first"]:
                seen["first"] = True
                torch.save(module.state_dict(), out / f"first-rank{rank}.pt")

        model.register_forward_pre_hook(first_forward)
        atexit.register(lambda: torch.save(model.state_dict(), out / f"final-rank{rank}.pt"))
    return model


class Recorded(Dataset[Any]):
    """A dataset that logs every index read, optionally slowly or failing after a while."""

    def __init__(
        self, inner: Any, log: list[int], delay_s: float = 0.0, fail_after: int | None = None
    ) -> None:
        self.inner = inner
        self.log = log
        self.delay_s = delay_s
        self.fail_after = fail_after

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        if self.fail_after is not None and len(self.log) >= self.fail_after:
            raise RuntimeError(f"sample {index} is corrupt (a test asked rank {_rank()} to fail)")
        self.log.append(int(index))
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.inner[index]


def build_dataset(
    record_dir: str | None = None,
    val_size: int | None = None,
    delay_s: float = 0.0,
    fail_on_rank: int | None = None,
    fail_after: int = 0,
    without_val: bool = False,
) -> tuple[Dataset[Any], Dataset[Any] | None]:
    """digits.build_dataset, recorded; ``val_size`` keeps the first N validation samples."""
    train, val = digits.build_dataset()
    if val_size is not None:
        val = Subset(val, range(val_size))
    rank = _rank()
    logs: dict[str, list[int]] = {"train": [], "val": []}
    failing = fail_after if fail_on_rank == rank else None
    recorded_train = Recorded(train, logs["train"], delay_s, failing)
    recorded_val = Recorded(val, logs["val"])
    if record_dir is not None:
        path = Path(record_dir) / f"samples-rank{rank}.json"
        atexit.register(lambda: path.write_text(json.dumps(logs)))
    return recorded_train, None if without_val else recorded_val


def mean_abs_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A custom loss (``train_probe:mean_abs_error``): L1 between softmax and one-hot."""
    one_hot = torch.nn.functional.one_hot(target, output.shape[-1]).to(output.dtype)
    return (output.softmax(dim=-1) - one_hot).abs().sum(dim=-1).mean()


class Block(torch.nn.Module):
    """A residual MLP block: the repeated unit FSDP's ``wrap: auto`` finds."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


class Blocks(torch.nn.Module):
    """The digits classifier as a stack of blocks (an odd width: shards that do not divide)."""

    def __init__(self, width: int = 67, depth: int = 3) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(digits.IMAGE_PIXELS, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.out = torch.nn.Linear(width, digits.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def build_blocks(width: int = 67, depth: int = 3) -> torch.nn.Module:
    """A block model for the sharded tests."""
    return Blocks(width, depth)


def build_slow(delay_s: float = 30.0, **kwargs: Any) -> torch.nn.Module:
    """digits.build_model after ``delay_s`` seconds: a factory that takes too long to plan."""
    time.sleep(delay_s)
    return digits.build_model(**kwargs)


def build_weighted(**kwargs: Any) -> tuple[Dataset[Any], Dataset[Any]]:
    """The digits with a per-sample weight (1 to 5, fixed by the sample's index), as a dataset
    of token counts would carry: items ``(input, target, weight)``."""
    from digits import build_dataset as digits
    from torch.utils.data import TensorDataset

    def weighted(data: Any) -> TensorDataset:
        inputs, targets = data.tensors
        weights = (torch.arange(len(targets)) * 7 % 5 + 1).to(torch.float32)
        return TensorDataset(inputs, targets, weights)

    train, val = digits(**kwargs)
    return weighted(train), weighted(val)
