"""Taking a checkpoint of a training run: what it holds, and who writes it.

Every rank sends its part (:class:`RankPart`: its RNG states and running loss) to rank 0 on the
control group, and says whether its loss and weights are finite: a checkpoint of NaN weights
would rotate the last good ones out, so then nothing is written and training stops. Under DDP
rank 0 alone writes one file (:func:`orchestrate.train.checkpoint.save`); under FSDP every rank
writes its shards into one folder and rank 0 adds the rest (:mod:`orchestrate.train.distcp`).
The layout of what is kept is in docs/train.md ("Checkpoints").

With ``checkpoint_async`` a periodic checkpoint is copied to host memory in the step and
written by the rank's background :class:`~orchestrate.train.asyncsave.Writer` (one in flight);
a checkpoint with a barrier (a stop, the end) waits for it and is written synchronously.

The trainer and this module meet at two values: the trainer hands a :class:`TrainState` (what a
checkpoint reads of it, its running sums folded in) to its :class:`Checkpointer`, which owns
where checkpoints go and which one was taken last. The state is asked for only once a
checkpoint will be written: folding the sums waits for the device.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from orchestrate.core.metricrecord import MetricRecord
from orchestrate.core.spec.trainspec import TrainSpec
from orchestrate.diagnosis import sidecar
from orchestrate.train import asyncsave, checkpoint, distcp, partwrite, rng
from orchestrate.train.distributed import Cluster
from orchestrate.train.failure import NonFiniteLoss
from orchestrate.train.metrics import MetricsLog

#: Where training is: ``(epoch, batches done in it, optimizer steps)``.
Where = tuple[int, int, int]


@dataclass(frozen=True)
class TrainState:
    """The trainer at one position, as a checkpoint reads it."""

    spec: TrainSpec
    model: torch.nn.Module  # DDP's wrapper, or the FSDP-sharded module
    module: torch.nn.Module  # the user's model (inside DDP's wrapper, or the sharded one)
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR | None
    scaler: torch.amp.GradScaler | None
    sharded: bool
    epoch: int  # 0-based
    batch: int  # batches of ``epoch`` done
    step: int  # optimizer steps done
    loss_sum: float  # this rank's loss sum over the epoch so far
    samples: int  # and its sample count
    # This rank's running loss and every weight it holds are finite: never a checkpoint of
    # NaN weights, it would rotate the last good ones out.
    finite: bool
    shares: tuple[int, ...] | None  # every rank's share of the global batch


@dataclass(frozen=True)
class RankPart:
    """One rank's part of a checkpoint, as every rank gathers it: what is kept of it (``ranks[R]``
    in the checkpoint, read back by :func:`orchestrate.train.build.restore`) and what is only
    looked at (whether it is finite; its pid, rank 0's names the temporary folder; whether a
    background save's copy fits its host)."""

    generators: rng.RngState
    loss_sum: float
    samples: int
    finite: bool
    pid: int
    room: str | None = None  # why a background save's host-memory copy would not fit here

    @classmethod
    def of(cls, state: TrainState, cuda: bool, room: str | None = None) -> RankPart:
        """This rank's part (its generators' states now)."""
        return cls(rng.capture(cuda), state.loss_sum, state.samples, state.finite, os.getpid(),
                   room)

    def kept(self) -> dict[str, Any]:
        """What the checkpoint keeps of it (plain values: it loads with ``weights_only``)."""
        return {"rng": self.generators, "train_loss_sum": self.loss_sum,
                "train_samples": self.samples}


@dataclass
class Checkpointer:
    """Takes a rank's checkpoints (a collective on every rank) and remembers the last one."""

    cluster: Cluster
    directory: Path
    keep: int  # checkpoints kept (keep_checkpoints)
    metrics: MetricsLog
    last_saved: Where | None = None  # the position of the last checkpoint (resumed from one)
    last: Path | None = None  # the newest checkpoint (rank 0 knows it)
    #: checkpoint_async: None until the first save decides (host memory), then True or False
    asynchronous: bool | None = False
    group: dist.ProcessGroup | None = None  # the background writes' own gloo group
    #: DDP: the ranks that write a background checkpoint's shares (those that see rank 0's
    #: checkpoint directory on rank 0's host: partwrite.sharers), in group order
    sharers: tuple[int, ...] = (0,)
    writer: asyncsave.Writer = field(default_factory=asyncsave.Writer)
    #: DDP: this rank's host copy of its share, reused by every background save in shares
    parts: partwrite.PartCopy = field(default_factory=partwrite.PartCopy)
    #: DDP, rank 0 the only sharer: the whole model's and optimizer's host copy, reused
    host: asyncsave.HostCopy = field(default_factory=asyncsave.HostCopy)
    staging: Any = None  # FSDP: distcp.stager(), made at the first background save

    def save(self, where: Where, take: Callable[[], TrainState], *, barrier: bool) -> None:
        """Checkpoint the trainer at ``where``; ``take`` gives its state (called only when a
        checkpoint is written: not twice at one position).

        With ``barrier`` no rank returns before the checkpoint (and the one before it, written
        in the background) is on disk: after a stop signal a launcher may kill every rank as
        soon as one of them exits.
        """
        control = self.cluster.control
        if self.last_saved == where:  # e.g. a periodic checkpoint at the stop step
            if barrier:
                self.drain()
                self._settled(control)
            return
        sidecar.phase("checkpoint", where[2])
        self._one_in_flight(where[2])
        state = take()
        ranks = self._gather(state)
        bad = [rank for rank, part in enumerate(ranks) if not part.finite]
        if bad:
            raise NonFiniteLoss(state.epoch + 1, state.step, bad, self.last)
        self._decide(ranks)
        side = self._side_state(state, ranks) if self.cluster.rank == 0 else {}
        if self.asynchronous and not barrier:
            self._start(state, side, tag=ranks[0].pid)
        else:
            path = self._write(state, side, tag=ranks[0].pid)
            if path is not None:
                self._announce(state, path)
        if barrier:
            self._settled(control)
        self.last_saved = where
        # Out of the slow phase: a rank stuck after it (in its data) must not count as busy
        # checkpointing (docs/hangs.md, distributed.busy_s).
        sidecar.phase("step", state.step)

    def _settled(self, control: dist.ProcessGroup | None) -> None:
        """Every rank's writes done (a stop, the end): the spare file the background writes
        reuse is deleted, no rank returns before."""
        if self.cluster.rank == 0:
            partwrite.spare_in(self.directory).unlink(missing_ok=True)
        if control is not None:
            dist.barrier(group=control)

    def drain(self) -> None:
        """Wait for the write in flight (the stop and end paths; raises its failure)."""
        self.writer.wait()

    def _one_in_flight(self, step: int) -> None:
        """Wait for the background write before a new checkpoint, saying so if it was busy."""
        busy = self.writer.busy
        waited = self.writer.wait()
        if busy is not None and waited is not None:
            self.metrics.say(f"checkpoint at step {step} waited {waited[1]:.2f} s for "
                             f"{busy} (one save in flight at a time)")

    def _needs(self, state: TrainState) -> int:
        """Bytes this rank would copy to host memory for a background save."""
        if state.sharded:
            return asyncsave.tensor_bytes(distcp.states(state.model, state.optimizer))
        if self.cluster.rank not in self.sharers:
            return 0
        return partwrite.PartCopy.needs(state.module, state.optimizer,
                                        rank=self.sharers.index(self.cluster.rank),
                                        ranks=len(self.sharers))

    def _decide(self, ranks: list[RankPart]) -> None:
        """At the first save: background saves only if every rank's copy fits its host."""
        if self.asynchronous is not None:
            return
        problems = [(rank, part.room) for rank, part in enumerate(ranks) if part.room]
        self.asynchronous = not problems
        if not problems:
            by = "" if len(self.sharers) < 2 else \
                f", each in shares by ranks {', '.join(map(str, self.sharers))}"
            self.metrics.say("checkpoint_async: checkpoints are copied to host memory and "
                             f"written in the background (one at a time{by})")
        else:
            rank, why = problems[0]
            self.metrics.say(f"checkpoint_async: saving synchronously instead: rank {rank}: "
                             f"{why}")

    def _gather(self, state: TrainState) -> list[RankPart]:
        """Every rank's part of the checkpoint, in rank order."""
        room = None
        if self.asynchronous is None:
            copies = self.cluster.env.local_world_size if state.sharded else 1
            room = asyncsave.room_problem(self._needs(state), copies,
                                          asyncsave.available_bytes())
        mine = RankPart.of(state, self.cluster.device.type == "cuda", room)
        if self.cluster.control is None:
            return [mine]
        ranks: list[Any] = [None] * self.cluster.world_size
        dist.all_gather_object(ranks, mine, group=self.cluster.control)
        return ranks
    def _side_state(self, state: TrainState, ranks: list[RankPart]) -> dict[str, Any]:
        """Everything but the model and the optimizer: the schedule, the position, the ranks."""
        spec = state.spec
        return {
            "format": checkpoint.FORMAT,
            "scheduler": None if state.scheduler is None else state.scheduler.state_dict(),
            "scaler": None if state.scaler is None else state.scaler.state_dict(),
            "epoch": state.epoch,
            "batch_in_epoch": state.batch,
            "step": state.step,
            "world_size": self.cluster.world_size,
            "batch_size": spec.batch_size,
            "batch_shares": None if state.shares is None else list(state.shares),
            "strategy": "fsdp" if state.sharded else "ddp",
            "sampler": {"epoch": state.epoch, "seed": spec.seed,
                        "samples_done_per_rank": state.batch * spec.batch_size},
            "ranks": [part.kept() for part in ranks],
            "config": spec.model_dump(mode="json"),
            "time": time.time(),
        }

    def _write(self, state: TrainState, side: dict[str, Any], *, tag: int) -> Path | None:
        """Write the checkpoint: every rank its shards under FSDP, rank 0 the file under DDP;
        rank 0 gets its path."""
        rank = self.cluster.rank
        if state.sharded:
            return distcp.save(state.model, state.optimizer, side, directory=self.directory,
                               step=state.step, keep=self.keep, rank=rank, tag=tag,
                               group=self.cluster.control)
        if rank != 0:
            return None
        whole = {**side, "model": state.module.state_dict(),
                 "optimizer": state.optimizer.state_dict()}
        return checkpoint.save(whole, self.directory, state.step, self.keep)

    def _start(self, state: TrainState, side: dict[str, Any], *, tag: int) -> None:
        """Copy this rank's part to host memory now; write it in the background."""
        name = checkpoint.name_for(state.step, sharded=state.sharded)
        directory, keep, step = self.directory, self.keep, state.step
        copied = asyncsave.snapshot(side)
        if state.sharded:
            if self.staging is None:
                self.staging = distcp.stager()
            future = distcp.save_async(state.model, state.optimizer, directory=directory,
                                       step=step, tag=tag, group=self.group,
                                       staging=self.staging)
            temporary = distcp.temporary_for(directory, step, tag)

            def write() -> None:
                future.result()
                if self.cluster.rank == 0:
                    self._announce(state, distcp.finish(
                        copied, directory=directory, step=step, keep=keep, temporary=temporary))
        elif len(self.sharers) > 1 and self.cluster.rank in self.sharers:
            write = self._start_shares(state, copied)
        elif self.cluster.rank == 0:  # rank 0 alone: torch.save of its whole host copy
            host = self.host
            copied.update(host.take({"model": state.module.state_dict(),
                                     "optimizer": state.optimizer.state_dict()}))

            def write() -> None:
                host.ready()
                self._announce(state, checkpoint.save(copied, directory, step, keep))
        else:
            return
        self.writer.start(name, write)

    def _start_shares(self, state: TrainState, side: dict[str, Any]) -> Callable[[], None]:
        """DDP, every sharer: copy this rank's share now (rank 0 also writes the frame); the
        returned write puts the share in the file (train/partwrite.py)."""
        index = self.sharers.index(self.cluster.rank)
        share = self.parts.take(state.module, state.optimizer, side, rank=index,
                                ranks=len(self.sharers))
        job = partwrite.start(share, directory=self.directory, step=state.step, keep=self.keep,
                              rank=index, group=self.group)
        ready = self.parts.ready

        def write() -> None:
            path = job.run(ready)
            if path is not None:
                self._announce(state, path)
        return write

    def _announce(self, state: TrainState, path: Path) -> None:
        self.last = path
        self.metrics.say(f"checkpoint {path} (epoch {state.epoch + 1}, step {state.step})")
        done = state.epoch + (0 if state.batch == 0 else 1)
        self.metrics.record(MetricRecord("checkpoint", epoch=done, step=state.step,
                                         time=time.time(), path=str(path)))
