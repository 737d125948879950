"""A model that cannot learn: every weight's gradient exactly 0, step after step, on every rank.

Weights initialised to 0 (an MLP whose layers are all zeros: no signal reaches any weight, only
the last bias moves), or an output that does not depend on the weights, trained to a quiet
COMPLETED with nothing learned (issue #33 item 7). Such gradients are exactly 0, not small, so
the check is exact: before each of the first :data:`STEPS` optimizer steps (an optimizer
step pre-hook: nothing in the training loop changes) it asks whether every weight tensor's
gradient (the parameters of two or more dimensions; all of them when there are none) is 0 or
absent here, and, under FSDP, where each rank holds a shard, on every rank (one all-reduce on
the control group). If so for all :data:`STEPS` of them, every rank stops at the same step with
:class:`NothingTrains` (exit 1, one sentence from rank 0), instead of running to COMPLETED.
One step is not enough: a first batch can leave a layer without a gradient that the next fills.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from orchestrate.train.distributed import Cluster
from orchestrate.train.failure import AgreedStop

#: How many first optimizer steps must all have exactly-0 weight gradients.
STEPS = 3


class NothingTrains(AgreedStop):
    """Every weight's gradient was exactly 0 for the first :data:`STEPS` steps."""

    def __init__(self, count: int) -> None:
        super().__init__(
            f"the gradient of every weight ({count} tensor(s)) was exactly 0 for the first "
            f"{STEPS} steps on every rank: nothing trains (weights initialised to 0? an output "
            "that does not depend on them?); stopped rather than end COMPLETED having learned "
            "nothing")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor: this rank's shard
    return to_local() if callable(to_local) else tensor


class ZeroGradientWatch:
    """The pre-hook of the first :data:`STEPS` optimizer steps (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, cluster: Cluster, sharded: bool) -> None:
        params = [p for p in module.parameters() if p.requires_grad]
        self.weights = [p for p in params if p.dim() >= 2] or params
        self.cluster = cluster
        self.sharded = sharded
        self.zero_steps = 0
        self.seen = 0
        self.handle: Any = None

    def install(self, optimizer: torch.optim.Optimizer) -> None:
        """Watch ``optimizer``'s first steps."""
        self.handle = optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self.seen += 1
        if self._all_zero():
            self.zero_steps += 1
        if self.seen >= STEPS:
            self.handle.remove()
            if self.zero_steps == STEPS:
                raise NothingTrains(len(self.weights))

    def _all_zero(self) -> bool:
        mine = all(p.grad is None or not bool(_local(p.grad).any()) for p in self.weights)
        if not self.sharded or self.cluster.control is None:
            return mine  # DDP: the gradients are the same on every rank, averaged
        flag = torch.tensor([0 if mine else 1], dtype=torch.int64)
        dist.all_reduce(flag, group=self.cluster.control)
        return int(flag.item()) == 0
