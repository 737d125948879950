"""Stopping on request: a signal sets a flag, and all ranks agree on it at step boundaries.

Slurm sends SIGTERM (or, with ``--signal``, SIGUSR2) before a time limit or a preemption; cloud
schedulers do the same. Checkpointing *inside* a signal handler fails intermittently (it runs at an
arbitrary point, possibly inside a collective), so the handler only records the signal. At every
optimizer-step boundary the ranks all-reduce the flag with MAX, so a signal delivered to any one
rank stops all of them at the same step; rank 0 then checkpoints and every rank exits with
:data:`~orchestrate.train.config.EXIT_REQUEUE` (75). SIGUSR1 is never used: NCCL claims it.

The exchange is started asynchronously on the CPU control group when a step begins and read when
it ends, so it overlaps the step's computation instead of adding a round trip to it.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist


class StopFlag:
    """Remembers the first stop signal received; the handler does nothing else."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def is_set(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name

    def install(self, names: Iterable[str]) -> None:
        """Handle each named signal (e.g. ``"SIGTERM"``) by setting the flag."""
        for name in names:
            sig = signal.Signals[name]
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class StopAgreement:
    """The all-ranks view of a :class:`StopFlag`, exchanged once per optimizer step."""

    def __init__(self, flag: StopFlag, group: dist.ProcessGroup | None) -> None:
        self.flag = flag
        self._group = group
        self._buffer = torch.zeros(1, dtype=torch.int32)
        self._work: Any = None
        self.agreed = False

    def begin(self) -> None:
        """Start exchanging this rank's flag (a no-op in a single-process job)."""
        if self._group is None or self._work is not None:
            return
        self._buffer.fill_(1 if self.flag.is_set else 0)
        self._work = dist.all_reduce(
            self._buffer, op=dist.ReduceOp.MAX, group=self._group, async_op=True
        )

    def settle(self) -> bool:
        """Finish the exchange; True when some rank was asked to stop (sticky once True)."""
        if self._group is None:
            self.agreed = self.agreed or self.flag.is_set
            return self.agreed
        if self._work is None:
            self.begin()
        work, self._work = self._work, None
        work.wait()
        self.agreed = self.agreed or bool(self._buffer.item())
        return self.agreed


def signal_names(names: Iterable[str]) -> list[str]:
    """The names, checked against what the platform has (SIGUSR2 is absent on Windows)."""
    return [name for name in names if hasattr(signal, name)]

