"""Dataset factory for a ``train:`` job whose rank ``stuck_rank`` stops in its data loading."""

from __future__ import annotations

import os
import time
from typing import Any

import digits
from torch.utils.data import Dataset


class StuckAfter(Dataset):  # type: ignore[type-arg]
    """The digits training set; on one rank the ``after``-th read never returns."""

    def __init__(self, inner: Any, rank: int, after: int) -> None:
        self.inner = inner
        self.rank = rank
        self.after = after
        self.reads = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        self.reads += 1
        if self.reads == self.after and int(os.environ["RANK"]) == self.rank:
            marks = os.environ.get("MARKS")
            if marks:
                with open(os.path.join(marks, "trigger"), "w") as handle:
                    handle.write(str(time.time()))
            time.sleep(3600)  # the read that never returns
        return self.inner[index]


def build_dataset(stuck_rank: int = 1, after: int = 2000) -> tuple[Any, Any]:
    train, val = digits.build_dataset()
    return StuckAfter(train, stuck_rank, after), val
