"""Factories for ``train:`` jobs whose rank 0 is slow but healthy (docs/hangs.md, busy ranks).

``slow_train:build_model``: the digits MLP whose ``state_dict``, when the trainer's checkpoint
asks for it, reads slow storage on rank 0 for ``slow_s`` (once per process: every attempt of a
restarted job is as slow). ``slow_train:build_dataset``: the digits data whose first validation
read on rank 0 is as slow. The slow read is programs/slowstore.py's (the main thread sleeps in
read(2) on a file); at its start rank 0 writes ``$MARKS/trigger``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import digits
from slowstore import slow_read
from torch import nn
from torch.utils.data import Dataset

_done: set[str] = set()


def _rank0_first(what: str) -> bool:
    """True on rank 0 the first time this process gets here for ``what`` (and marks it)."""
    if int(os.environ.get("RANK", "0")) != 0 or what in _done:
        return False
    _done.add(what)
    marks = os.environ.get("MARKS")
    if marks:
        with open(os.path.join(marks, "trigger"), "w") as handle:
            handle.write(str(time.time()))
    return True


class SlowToSave(nn.Sequential):
    """The digits MLP; the trainer's checkpoint (its ``save``) waits on slow storage once."""

    slow_s = 0.0

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if _saving() and _rank0_first("checkpoint"):
            slow_read(self.slow_s)
        return super().state_dict(*args, **kwargs)


def _saving() -> bool:
    """Whether the trainer's checkpoint code asks (a caller in orchestrate.train.saving, by
    module rather than by a function's name, which a refactor renames)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") == "orchestrate.train.saving":
            return True
        frame = frame.f_back
    return False


def build_model(slow_s: float = 22.0, hidden: int = 32) -> nn.Module:
    model = SlowToSave(*digits.build_model(hidden=hidden))
    model.slow_s = slow_s
    return model


class SlowValidation(Dataset):  # type: ignore[type-arg]
    """The digits validation set; rank 0's first read waits on slow storage."""

    def __init__(self, inner: Any, slow_s: float) -> None:
        self.inner = inner
        self.slow_s = slow_s

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        if _rank0_first("eval"):
            slow_read(self.slow_s)
        return self.inner[index]


def build_dataset(slow_s: float = 22.0) -> tuple[Any, Any]:
    train, val = digits.build_dataset()
    return train, SlowValidation(val, slow_s)
