"""Stopping on request: a signal sets a flag, and all ranks agree on it at step boundaries.

Slurm sends SIGTERM (or, with ``--signal``, SIGUSR2) before a time limit or a preemption; cloud
schedulers do the same. Checkpointing *inside* a signal handler fails intermittently (it runs at an
arbitrary point, possibly inside a collective), so the handler only records the signal. At
optimizer-step boundaries the ranks all-reduce the flag with MAX, so a signal delivered to any one
rank stops all of them at the same step; rank 0 then checkpoints and every rank exits with
:data:`~orchestrate.core.exits.EXIT_REQUEUE` (75). SIGUSR1 is never used: NCCL claims it.

The exchange runs on the CPU control group (no GPU synchronization) at an adaptive cadence of
about twice per second; see :class:`StopAgreement`.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable
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
    """The all-ranks view of a :class:`StopFlag`, exchanged at optimizer-step boundaries.

    An all-reduce per step costs a network round trip, which is a quarter of the step time of a
    small model on gloo (measured: docs/train.md). So the exchange runs every ``every`` steps,
    where ``every`` adapts so that exchanges happen about every :attr:`INTERVAL_S` seconds: each
    exchange also carries the slowest rank's time per step since the previous one, and every
    rank derives the next ``every`` from those identical numbers, so all ranks keep exchanging
    (and stopping) at the same steps. A stop is noticed within about ``INTERVAL_S`` plus a step.

    The same exchange carries a health flag (``unhealthy``, e.g. "my running loss is not
    finite"), so a NaN on any rank stops every rank at the same step, before a checkpoint can
    store NaN weights: :attr:`unhealthy_agreed`.
    """

    INTERVAL_S = 0.5
    MAX_EVERY = 10_000

    def __init__(self, flag: StopFlag, group: dist.ProcessGroup | None,
                 unhealthy: Callable[[], bool] = lambda: False) -> None:
        self.flag = flag
        self._group = group
        self.unhealthy = unhealthy
        # stop flag, seconds per step, unhealthy flag
        self._buffer = torch.zeros(3, dtype=torch.float64)
        self.every = 1
        self._since = 0
        self._last = time.perf_counter()
        self.agreed = False
        self.unhealthy_agreed = False

    def step_done(self) -> bool:
        """Call on every rank after every optimizer step; True when all ranks must stop (a
        stop signal, or :attr:`unhealthy_agreed`)."""
        self._since += 1
        if self._since < self.every:
            return self.agreed or self.unhealthy_agreed
        now = time.perf_counter()
        self._buffer[0] = 1.0 if self.flag.is_set else 0.0
        self._buffer[1] = (now - self._last) / self._since
        self._buffer[2] = 1.0 if self.unhealthy() else 0.0
        if self._group is not None:
            dist.all_reduce(self._buffer, op=dist.ReduceOp.MAX, group=self._group)
        stop, per_step, unhealthy = self._buffer.tolist()
        self._since, self._last = 0, now
        self.every = next_interval(per_step, self.INTERVAL_S, self.MAX_EVERY)
        self.agreed = self.agreed or stop > 0
        self.unhealthy_agreed = self.unhealthy_agreed or unhealthy > 0
        return self.agreed or self.unhealthy_agreed


def next_interval(per_step_s: float, interval_s: float, most: int) -> int:
    """Steps until the next exchange, so that exchanges are about ``interval_s`` apart."""
    if not per_step_s > 0:
        return 1
    return max(1, min(most, int(interval_s / per_step_s)))


def signal_names(names: Iterable[str]) -> list[str]:
    """The names, checked against what the platform has (SIGUSR2 is absent on Windows)."""
    return [name for name in names if hasattr(signal, name)]

