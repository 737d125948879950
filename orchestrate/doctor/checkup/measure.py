"""Timing collectives so that the link is measured, not the tool.

Like stas00's all_reduce_bench and nccl-tests with ``-z 1``: one *blocking* operation per
iteration, a barrier before each, timed with CUDA events on GPUs (the host clock on CPUs), after
warm-up operations that pay for connection setup and allocation. Nothing else happens between
the start and the end of a timed operation.

Point-to-point: the sender times ``send(big); recv(ack)`` (a 4-byte acknowledgement, so the
time covers delivery, not a buffer hand-off), the receiver answers. A one-element flag before each
transfer tells the receiver whether another one follows, so the sender alone decides how many
fit the time budget and the pair never disagrees.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from orchestrate.doctor.checkup.schedule import plan_iters

#: The smoke all_reduce: 1 MiB of float32, big enough to leave the small-message path.
SMOKE_ELEMENTS = 1 << 18


class CheckFailed(Exception):
    """A collective returned a wrong result on this rank."""


class Clock:
    """Seconds an operation took on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time(self, op: Callable[[], object]) -> float:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            op()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1000.0
        begin = time.perf_counter()
        op()
        return time.perf_counter() - begin

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def expected_sums(world_size: int) -> list[float]:
    """Element i of the smoke all_reduce sums ``((i + r) % 8) + 1`` over ranks r: it depends on
    i % 8 only. Exact in float32 up to 2 million ranks."""
    return [float(sum((j + r) % 8 + 1 for r in range(world_size))) for j in range(8)]


def checked_all_reduce(device: torch.device, rank: int, world_size: int,
                       group: dist.ProcessGroup | None = None) -> None:
    """all_reduce a rank-dependent tensor and check every element; raises :class:`CheckFailed`."""
    index = torch.arange(SMOKE_ELEMENTS, dtype=torch.int64)
    tensor = ((index + rank) % 8 + 1).to(torch.float32).to(device)
    dist.all_reduce(tensor, group=group)
    got = tensor.cpu()
    want = torch.tensor(expected_sums(world_size), dtype=torch.float32)[index % 8]
    if not torch.equal(got, want):
        wrong = (got != want).nonzero().flatten()
        first = int(wrong[0])
        raise CheckFailed(
            f"all_reduce result is wrong: element {first} is {float(got[first]):g}, expected "
            f"{float(want[first]):g} ({len(wrong)} of {SMOKE_ELEMENTS} elements differ)"
        )


@dataclass(frozen=True)
class Budget:
    """How much to measure: warm-up and timed operations, within a time budget per size."""

    warmup: int
    iters: int
    min_iters: int
    budget_s: float


class Bench:
    """The measurements of one rank. ``tick`` is called after every operation (the watchdog's
    sign of progress); ``control`` is the gloo group used to agree on iteration counts."""

    def __init__(
        self,
        device: torch.device,
        budget: Budget,
        control: dist.ProcessGroup | None,
        tick: Callable[[], None],
    ) -> None:
        self.device = device
        self.clock = Clock(device)
        self.budget = budget
        self.control = control
        self.tick = tick

    def agree_max(self, value: float) -> float:
        """The largest ``value`` over all ranks (a CPU all_reduce on the control group)."""
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.control)
        return float(tensor.item())

    def _timed_all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> float:
        dist.barrier(group=group)
        seconds = self.clock.time(lambda: dist.all_reduce(tensor, group=group))
        self.tick()
        return seconds

    def all_reduce_size(
        self, nbytes: int, group: dist.ProcessGroup | None, takes_part: bool
    ) -> tuple[int, float]:
        """(timed iterations, this rank's mean seconds per all_reduce) at one size; ranks that
        do not take part (a one-rank node in the intra-node sweep) only agree on the count."""
        tensor = None
        first = 0.0
        if takes_part:
            tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=self.device)
            first = self._timed_all_reduce(tensor, group)
        b = self.budget
        warm, iters = plan_iters(self.agree_max(first), b.warmup, b.iters, b.min_iters,
                                 b.budget_s)
        if tensor is None:
            return iters, 0.0
        for _ in range(warm):
            self._timed_all_reduce(tensor, group)
        times = [self._timed_all_reduce(tensor, group) for _ in range(iters)]
        return iters, sum(times) / len(times)

    def send_to(self, peer: int, nbytes: int) -> tuple[int, float]:
        """(timed transfers, mean seconds) sending ``nbytes`` to ``peer``, which runs
        :meth:`receive_from` at the same time."""
        big = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=self.device)
        ack = torch.zeros(1, dtype=torch.float32, device=self.device)
        flag = torch.ones(1, dtype=torch.int64, device=self.device)

        def once() -> float:
            self.clock.sync()
            begin = time.perf_counter()
            dist.send(big, peer)
            dist.recv(ack, peer)
            self.clock.sync()
            self.tick()
            return time.perf_counter() - begin

        dist.send(flag, peer)
        once()  # warm-up: connection set-up (and the pair's NCCL communicator on GPUs)
        b = self.budget
        times: list[float] = []
        started = time.monotonic()
        while True:
            more = len(times) < max(1, b.min_iters) or (
                len(times) < b.iters
                and (b.budget_s <= 0 or time.monotonic() - started < b.budget_s)
            )
            flag.fill_(1 if more else 0)
            dist.send(flag, peer)
            if not more:
                break
            times.append(once())
        return len(times), sum(times) / len(times)

    def receive_from(self, peer: int, nbytes: int) -> None:
        """The other end of :meth:`send_to`."""
        big = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=self.device)
        ack = torch.zeros(1, dtype=torch.float32, device=self.device)
        flag = torch.zeros(1, dtype=torch.int64, device=self.device)
        while True:
            dist.recv(flag, peer)
            if int(flag.item()) == 0:
                return
            dist.recv(big, peer)
            dist.send(ack, peer)
            self.tick()


def node_groups(
    members: Sequence[Sequence[int]], backend: str, timeout_s: float
) -> list[dist.ProcessGroup | None]:
    """One process group per node with more than one rank (None for the others). Every rank
    creates every group, in the same order, as torch requires."""
    from datetime import timedelta

    groups: list[dist.ProcessGroup | None] = []
    for ranks in members:
        if len(ranks) > 1:
            groups.append(dist.new_group(
                ranks=list(ranks), backend=backend, timeout=timedelta(seconds=timeout_s)
            ))
        else:
            groups.append(None)
    return groups
