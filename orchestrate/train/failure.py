"""The one exception type of a failed rank, carrying the line a person should read.

Under DDP the first error is easily buried: the other ranks report "connection closed" a moment
later. So a rank's own failure (a factory that raised, a checkpoint that does not fit) becomes a
:class:`TrainFailure` whose message is one line, printed as ``rank N: <message>``.
"""


from __future__ import annotations

from pathlib import Path


def first_line(exc: BaseException) -> str:
    """``ValueError: the first line of its message``."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


class TrainFailure(Exception):
    """This rank cannot go on; ``str(exc)`` is the line to print after ``rank N:``."""


class AgreedStop(TrainFailure):
    """Every rank stops at the same step for the same reason; rank 0 says it, once."""


class NonFiniteLoss(AgreedStop):
    """The loss (or the weights) went NaN or infinite: training stops on every rank at once,
    before a checkpoint of NaN weights could rotate the last good ones out."""

    def __init__(self, epoch: int, step: int, ranks: list[int], kept: Path | None) -> None:
        where = "rank " if len(ranks) == 1 else "ranks "
        where += ", ".join(map(str, ranks))
        last = f"the last finite checkpoint is kept: {kept}" if kept is not None else (
            "no checkpoint was written before it")
        super().__init__(
            f"the loss is not finite (NaN or inf) at epoch {epoch}, by step {step}, on {where}; "
            f"training stopped; {last} (lower the learning rate, clip gradients with "
            "train.grad_clip_norm, or check the data)"
        )
        self.epoch = epoch
        self.step = step
        self.ranks = ranks
