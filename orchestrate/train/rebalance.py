"""``batch_split: measured``: set the batch shares from each rank's own measured time.

Under DDP a fast rank waits for a slow one inside the gradient all-reduce, so step times say
nothing about who is slow: every rank's step lasts as long as the slowest's. What does tell them
apart is each rank's *own* work, timed so that no wait for another rank is inside it:

- fetching the batch from the DataLoader (host time);
- forward and backward compute: from the inner module's forward (a pre-hook, so DDP's buffer
  broadcast before it is not counted) to the moment DDP hands the *last* gradient bucket to the
  all-reduce (a DDP communication hook records it, then runs the stock all-reduce), when this
  rank's backward compute is done and only waiting remains. A micro-step without gradient
  synchronisation ends when ``backward()`` returns;
- the optimizer step (clipping, step, zeroing), which does not grow with the share.

So each rank's step costs about ``a_r + k * c_r * b_r`` seconds: ``a_r`` its optimizer time,
``c_r`` its compute time per sample, ``k`` micro-steps of ``b_r`` samples. After ``WARMUP_STEPS``
(allocator and DDP bucket rebuilding) the ranks time ``batch_measure_steps`` steps, gather the
figures, and every rank computes the same new shares (:func:`balanced_shares`): the split that
makes the predicted step times equal, each share within its rank's memory cap. The shares move
only if that shortens the predicted step by at least ``MIN_GAIN``, so noise does not shuffle a
balanced job. ``batch_rebalance: epoch`` measures again at the start of every epoch.

On CUDA the spans are CUDA events on the current stream (GPU time, read once when the
measurement ends); on CPU ``time.perf_counter``. Outside the measuring steps the hooks only
check a flag.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from orchestrate.core.plan.shares import NoSplit, apportion

#: Steps after a (re)start of measuring that are not timed: first-step allocations and DDP's
#: bucket rebuild after its first iteration would count as compute.
WARMUP_STEPS = 2
#: The least predicted shortening of a step (a fraction) for which the shares change.
MIN_GAIN = 0.05


@dataclass(frozen=True)
class RankCost:
    """One rank's measured cost model: ``fixed_s + samples * per_sample_s`` per step."""

    per_sample_s: float  # forward, backward and batch fetching, per sample
    fixed_s: float  # the optimizer step, per optimizer step

    def step_s(self, share: int, micro_steps: int) -> float:
        return self.fixed_s + micro_steps * share * self.per_sample_s


def predicted_step_s(costs: Sequence[RankCost], shares: Sequence[int], micro_steps: int
                     ) -> float:
    """How long a step takes with ``shares``: as long as its slowest rank's own work."""
    return max(c.step_s(b, micro_steps) for c, b in zip(costs, shares, strict=True))


def balanced_shares(total: int, costs: Sequence[RankCost], caps: Sequence[int | None],
                    micro_steps: int = 1) -> list[int]:
    """The shares of ``total`` samples per micro-step that make every rank's predicted step
    time equal, each at least 1 and at most its cap; raises :class:`NoSplit` if none fits.

    The step time ``T`` is found by bisection: at ``T`` rank r can take
    ``(T - fixed_r) / (k * per_sample_r)`` samples (clamped to [1, cap]), which grows with
    ``T``; the ``T`` at which the ranks together take ``total`` gives the real-valued shares,
    rounded by :func:`~orchestrate.core.plan.shares.apportion` (largest remainders, caps kept).
    """
    bounds = [float(total) if c is None else float(min(c, total)) for c in caps]
    rates = [max(c.per_sample_s, 1e-12) * micro_steps for c in costs]

    def take(t: float) -> list[float]:
        return [min(max((t - c.fixed_s) / rate, 1.0), bound)
                for c, rate, bound in zip(costs, rates, bounds, strict=True)]

    low = min(c.fixed_s for c in costs)
    high = max(c.fixed_s + rate * total for c, rate in zip(costs, rates, strict=True))
    for _ in range(100):
        middle = (low + high) / 2
        if sum(take(middle)) < total:
            low = middle
        else:
            high = middle
    return apportion(total, take(high), list(caps))


def _allreduce_timed(state: Rebalancer, bucket: GradBucket
                     ) -> torch.futures.Future[torch.Tensor]:
    """DDP's stock all-reduce, after noting when this bucket's gradients were ready."""
    state.gradients_ready()
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


# DDP checks the hook's annotations against the real classes; this module's are strings.
_allreduce_timed.__annotations__ = {
    "state": object, "bucket": GradBucket, "return": torch.futures.Future[torch.Tensor]}


@dataclass
class _Window:
    """What one measurement adds up (marks are floats on CPU, CUDA events on GPUs)."""

    spans: list[tuple[Any, Any]] = field(default_factory=list)  # compute, per-sample
    optimizer: list[tuple[Any, Any]] = field(default_factory=list)
    fetch_s: float = 0.0
    samples: int = 0
    steps: int = 0


class Rebalancer:
    """The measuring of one rank, and the agreement on new shares (see the module docstring).

    The trainer calls :meth:`fetched`, :meth:`micro_done` and :meth:`optimizer_started` /
    :meth:`optimizer_done` while :attr:`measuring`, and :meth:`step_done` after every optimizer
    step; when that returns shares, the trainer switches to them before the next step.
    """

    def __init__(self, model: torch.nn.Module, inner: torch.nn.Module, *,
                 shares: Sequence[int], caps: Sequence[int | None], micro_steps: int,
                 measure_steps: int, every_epoch: bool, control: Any, cuda: bool) -> None:
        self.shares = list(shares)
        self.caps = list(caps) if caps else [None] * len(self.shares)
        self.micro_steps = micro_steps
        self.measure_steps = measure_steps
        self.every_epoch = every_epoch
        self.control = control
        self.cuda = cuda
        self.last_costs: list[RankCost] | None = None
        self._skip = WARMUP_STEPS
        self._on = True
        self._armed = False
        self._forward: Any = None
        self._ready: Any = None
        self._window = _Window()
        self._hook = inner.register_forward_pre_hook(self._forward_started)
        if isinstance(model, DistributedDataParallel):
            model.register_comm_hook(self, _allreduce_timed)

    @property
    def measuring(self) -> bool:
        return self._on and self._skip == 0

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            return float(start.elapsed_time(end)) / 1000.0
        return float(end - start)

    # --- marks ------------------------------------------------------------------------------

    def arm(self) -> None:
        """The next forward of the inner module is a training micro-step's (not validation's,
        not activation checkpointing's recomputation)."""
        self._armed = self.measuring

    def _forward_started(self, *_: Any) -> None:
        if self._armed:
            self._armed = False
            self._forward = self._mark()
            self._ready = None

    def gradients_ready(self) -> None:
        if self.measuring and self._forward is not None:
            self._ready = self._mark()

    def fetched(self, seconds: float) -> None:
        if self.measuring:
            self._window.fetch_s += seconds

    def micro_done(self, samples: int) -> None:
        """Backward returned; the compute span ends at the last bucket handed over (or now,
        without synchronisation)."""
        if not self.measuring or self._forward is None:
            return
        end = self._ready if self._ready is not None else self._mark()
        self._window.spans.append((self._forward, end))
        self._window.samples += samples
        self._forward = self._ready = None

    def optimizer_started(self) -> Any:
        return self._mark() if self.measuring else None

    def optimizer_done(self, started: Any) -> None:
        if started is not None and self.measuring:
            self._window.optimizer.append((started, self._mark()))

    # --- decisions --------------------------------------------------------------------------

    def epoch_started(self) -> None:
        """Under ``batch_rebalance: epoch``, measure again (after a warm-up)."""
        if self.every_epoch and not self._on:
            self._on, self._skip, self._window = True, WARMUP_STEPS, _Window()

    def step_done(self) -> list[int] | None:
        """Count an optimizer step; at the end of a measurement every rank agrees on the
        shares (a collective on every rank at the same step) and gets them if they changed."""
        if not self._on:
            return None
        if self._skip:
            self._skip -= 1
            return None
        self._window.steps += 1
        if self._window.steps < self.measure_steps:
            return None
        mine = self._cost()
        costs: list[Any] = [mine]
        if self.control is not None:
            costs = [None] * len(self.shares)
            dist.all_gather_object(costs, mine, group=self.control)
        self._on = False
        self._window = _Window()
        self.last_costs = costs
        try:
            new = balanced_shares(sum(self.shares), self.last_costs, self.caps,
                                  self.micro_steps)
        except NoSplit:
            return None
        now = predicted_step_s(self.last_costs, self.shares, self.micro_steps)
        then = predicted_step_s(self.last_costs, new, self.micro_steps)
        if new == self.shares or then > now * (1.0 - MIN_GAIN):
            return None
        self.shares = new
        return new

    def _cost(self) -> RankCost:
        """This rank's measured cost model (the record every rank gathers)."""
        window = self._window
        if self.cuda:
            torch.cuda.synchronize()
        compute = sum(self._seconds(a, b) for a, b in window.spans) + window.fetch_s
        optimizer = sum(self._seconds(a, b) for a, b in window.optimizer)
        return RankCost(per_sample_s=compute / max(window.samples, 1),
                        fixed_s=optimizer / max(window.steps, 1))

    def close(self) -> None:
        self._hook.remove()
