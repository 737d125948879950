"""The training loop: epochs of optimizer steps, validation, metrics and checkpoints.

Position is counted in optimizer steps and in batches done within the current epoch, so a
checkpoint taken anywhere (end of epoch, every N steps, on a stop signal) resumes at exactly the
next batch: the sampler skips what was done, and the RNG states and loss accumulators come back
from the checkpoint. With the same seed and world size a resumed run ends with bit-identical
parameters (on GPUs, given deterministic kernels).

Gradient accumulation groups ``grad_accum_steps`` consecutive batches of an epoch (the last group
of an epoch may be shorter); all but a group's last backward run without gradient
synchronisation (DDP's ``no_sync()``, FSDP's ``set_requires_gradient_sync(False)``) so the
gradients are reduced once per optimizer step.

The model is DDP's wrapper around a replica, or under ``strategy: fsdp`` the user's module
sharded in place (:mod:`orchestrate.train.sharding`); the loop is the same for both.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

from orchestrate.core.metricrecord import MetricRecord
from orchestrate.core.spec.trainspec import TrainSpec
from orchestrate.diagnosis import sidecar
from orchestrate.train import sharding
from orchestrate.train.batchshares import RankBatch, SharedBatchSampler
from orchestrate.train.distributed import Cluster
from orchestrate.train.evaluate import evaluate
from orchestrate.train.failure import NonFiniteLoss, TrainFailure
from orchestrate.train.losses import LossFn, batch_loss, parts
from orchestrate.train.metrics import MetricsLog
from orchestrate.train.peakmemory import PeakMemory
from orchestrate.train.precision import PrecisionPlan
from orchestrate.train.preemption import StopAgreement
from orchestrate.train.rebalance import Rebalancer
from orchestrate.train.sampling import ResumableSampler
from orchestrate.train.saving import Checkpointer, TrainState
from orchestrate.train.timing import StepTiming

GB = 1e9
Outcome = Literal["completed", "preempted"]
EpochEnd = Literal["epoch_end", "stop", "max_steps"]
#: How a pass over the loader ended: ``reshared`` starts another pass with the new shares.
PassEnd = Literal["epoch_end", "stop", "max_steps", "reshared"]


@dataclass
class Position:
    """Where training is: ``batch`` batches of epoch ``epoch`` (0-based) are done."""

    epoch: int = 0
    batch: int = 0
    step: int = 0


@dataclass
class EpochTotals:
    """This rank's running sums for the current epoch (kept in checkpoints)."""

    loss_sum: float = 0.0
    samples: int = 0


def loader_seed(seed: int, rank: int, epoch: int) -> int:
    """Seed of the DataLoader's generator (worker seeds) for one rank and epoch."""
    return (seed * 1_000_003 + rank * 7_919 + epoch * 104_729) % 2**63


@dataclass
class Trainer:
    """Everything a rank needs to train, already built, loaded and agreed on."""

    spec: TrainSpec
    cluster: Cluster
    model: torch.nn.Module  # DDP's wrapper, or the FSDP-sharded module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR | None
    precision: PrecisionPlan
    loss_fn: LossFn
    sampler: ResumableSampler | SharedBatchSampler
    train_loader: DataLoader[Any]
    loader_generator: torch.Generator
    val_loader: DataLoader[Any] | None
    stop: StopAgreement
    metrics: MetricsLog
    checkpoints: Checkpointer  # where checkpoints go, and the last one taken
    position: Position = field(default_factory=Position)
    totals: EpochTotals = field(default_factory=EpochTotals)
    resumed_from: int | None = None
    passed_over: tuple[str, ...] = ()  # newer checkpoints not whole (rank 0: build.Built)
    timing: StepTiming = field(default_factory=StepTiming.off)
    peak: PeakMemory | None = None
    val_set: Any = None  # the whole validation set (FSDP's evaluation borrows a sample)
    #: ``b_r * W / B`` under global_batch_size (orchestrate.train.batchshares), else 1
    loss_scale: float = 1.0
    shares: tuple[int, ...] | None = None  # every rank's share of the global batch
    rebalancer: Rebalancer | None = None  # batch_split: measured
    _started: bool = False
    # Loss and samples since the last fold into ``totals``; on the device, so that a step
    # never waits for the GPU just to keep a running sum.
    _pending_loss: torch.Tensor | None = None
    _pending_samples: int = 0
    _epoch_started: float = 0.0
    _epoch_samples_here: int = 0  # trained by this process this epoch (for samples/s)
    _interval: tuple[float, float, float] = (0.0, 0.0, 0.0)  # loss sum, samples, clock at last log

    @property
    def module(self) -> torch.nn.Module:
        """The user's model: inside DDP, or the sharded module itself."""
        if isinstance(self.model, DistributedDataParallel):
            module: torch.nn.Module = self.model.module
            return module
        return self.model

    @property
    def sharded(self) -> bool:
        return sharding.is_sharded(self.model)

    @property
    def batches_per_epoch(self) -> int:
        if isinstance(self.sampler, SharedBatchSampler):
            return self.sampler.steps
        return math.ceil(self.sampler.num_samples / self.spec.batch_size)

    @property
    def _where(self) -> tuple[int, int, int]:
        return (self.position.epoch, self.position.batch, self.position.step)

    def _running(self) -> tuple[float, int]:
        """This rank's loss sum and sample count over the epoch so far."""
        pending = 0.0 if self._pending_loss is None else float(self._pending_loss.item())
        return self.totals.loss_sum + pending, self.totals.samples + self._pending_samples

    def _at_max_steps(self) -> bool:
        return self.spec.max_steps is not None and self.position.step >= self.spec.max_steps

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> Outcome:
        """Train until the epochs (or ``max_steps``) are done or a stop signal is agreed on."""
        every = self.spec.checkpoint_every_steps
        while self.position.epoch < self.spec.epochs and not self._at_max_steps():
            end = self._train_epoch()
            if end == "stop":
                self.save(barrier=True)
                self._finish("preempted")
                return "preempted"
            self._close_epoch(complete=end == "epoch_end")
            if end == "epoch_end" and every == 0:
                self.save(barrier=False)
        self.save(barrier=True)
        self._finish("completed")
        return "completed"

    def _train_epoch(self) -> EpochEnd:
        spec = self.spec
        self.sampler.set_epoch(self.position.epoch)
        self.loader_generator.manual_seed(
            loader_seed(spec.seed, self.cluster.rank, self.position.epoch)
        )
        self._epoch_started = time.perf_counter()
        self._epoch_samples_here = 0
        self._pending_loss = torch.zeros((), dtype=torch.float64, device=self.cluster.device)
        self._pending_samples = 0
        self._interval = (*self._running(), self._epoch_started)
        if self.rebalancer is not None:
            self.rebalancer.epoch_started()
        while True:
            end = self._train_pass()
            if end != "reshared":
                return end

    def _train_pass(self) -> PassEnd:
        """Batches from where the epoch is to its end, a stop, or new shares."""
        spec = self.spec
        accum = spec.grad_accum_steps
        n_batches = self.batches_per_epoch
        shared = isinstance(self.sampler, SharedBatchSampler)
        # A shared sampler skips whole batches (global steps), the other one samples.
        self.sampler.skip = self.position.batch * (1 if shared else spec.batch_size)
        index = self.position.batch
        meter = self.rebalancer
        self.timing.resume()
        sidecar.phase("step", self.position.step)
        batches = iter(self.train_loader)
        while True:
            group_start = index - index % accum
            group_size = min(accum, n_batches - group_start)
            group = self._next_group(batches, group_start + group_size - index)
            if not group:
                return "epoch_end"
            scales = self._loss_scales(group, group_size)
            for k, (inputs, target, weight) in enumerate(group):
                if meter is not None:
                    meter.arm()
                self._micro_step(inputs, target, weight, scales[k],
                                 sync=k == len(group) - 1)
                if meter is not None:
                    meter.micro_done(len(target))
            index += len(group)
            self._measured_optimizer_step()
            self.position.step += 1
            self.timing.step_done(self.position.step, self.position.epoch + 1)
            self.position.batch = index
            sidecar.phase("step", self.position.step)
            stopping = self.stop.step_done()
            if self.stop.unhealthy_agreed:
                self._nonfinite()
            self._after_step()
            self.timing.resume()
            if stopping:
                return "stop"
            if self._at_max_steps() and index < n_batches:
                return "max_steps"
            new = None if meter is None else meter.step_done()
            if new is not None:
                self._reshare(tuple(new))
                if index < n_batches:
                    return "reshared"

    def _measured_optimizer_step(self) -> None:
        """The optimizer step, timed for measured shares, counted for the peak memory."""
        meter = self.rebalancer
        started = None if meter is None else meter.optimizer_started()
        self._optimizer_step()
        if meter is not None:
            meter.optimizer_done(started)
        if self.peak is not None:
            self.peak.step_done()

    def _next_group(self, batches: Iterator[Any], count: int
                    ) -> list[tuple[Any, Any, torch.Tensor | None]]:
        """The next ``count`` batches (one optimizer step's), fetched before the first of them
        runs: per-sample weights scale each by its share of the whole step's weight. Fewer
        (none) at the end of the loader."""
        group: list[tuple[Any, Any, torch.Tensor | None]] = []
        for _ in range(count):
            fetching = time.perf_counter()
            try:
                batch = parts(next(batches))
            except StopIteration:
                break
            if self.rebalancer is not None:
                self.rebalancer.fetched(time.perf_counter() - fetching)
            self.timing.data_ready(len(batch[1]))
            group.append(batch)
        return group

    def _loss_scales(self, group: list[tuple[Any, Any, torch.Tensor | None]],
                     group_size: int) -> list[float]:
        """What each micro-batch's mean loss is multiplied by, so that the ranks' averaged
        gradient is the step's mean over all its samples (``b_r * W / B`` per
        :mod:`orchestrate.train.batchshares`, over the micro-steps) or, with per-sample
        weights, over all its weight: ``W * w_rk / sum of all w`` (one all-reduce)."""
        if all(weight is None for _, _, weight in group):
            return [self.loss_scale / group_size] * len(group)
        if any(weight is None for _, _, weight in group):
            raise TrainFailure("some batches carry per-sample weights and some do not: a "
                               "dataset yields (input, target) or (input, target, weight)")
        mine = [float(weight.sum()) for _, _, weight in group if weight is not None]
        total = self._all_reduce([sum(mine)])[0]
        world = self.cluster.world_size
        return [world * w / total if total > 0 else 0.0 for w in mine]

    def _reshare(self, shares: tuple[int, ...]) -> None:
        """Switch to measured shares between two steps: the loss scale and the sampler follow;
        the global batches stay the same."""
        assert isinstance(self.sampler, SharedBatchSampler) and self.shares is not None
        before = self.shares
        self.sampler.reshare(shares)
        mine = RankBatch(shares, self.cluster.rank)
        self.shares = shares
        self.loss_scale = mine.loss_scale
        self.spec = self.spec.model_copy(update={"batch_size": mine.size})
        self.timing.cut()
        self.metrics.record(MetricRecord(
            "shares", epoch=self.position.epoch + 1, step=self.position.step, time=time.time(),
            batch_shares=shares))
        meter = self.rebalancer
        costs = [] if meter is None or meter.last_costs is None else meter.last_costs
        per_sample = ", ".join(f"{c.per_sample_s * 1e3:.3g}" for c in costs)
        optimizer = ", ".join(f"{c.fixed_s * 1e3:.3g}" for c in costs)
        self.metrics.say(
            f"batch shares {list(before)} -> {list(shares)} at step {self.position.step} "
            f"(measured by rank: ms per sample {per_sample}; optimizer ms per step "
            f"{optimizer})")

    def _micro_step(self, inputs: torch.Tensor, target: torch.Tensor,
                    weight: torch.Tensor | None, scale: float, *, sync: bool) -> None:
        device = self.cluster.device
        inputs = self.precision.cast_input(inputs.to(device, non_blocking=True))
        target = target.to(device, non_blocking=True)
        if weight is not None:
            weight = weight.to(device, non_blocking=True)
        scaler = self.precision.scaler
        with sharding.sync_gradients(self.model, sync):
            with self.precision.autocast():
                output = self.model(inputs)
                loss = batch_loss(self.loss_fn, output, target, weight)
            self.timing.forward_done()
            scaled = loss * scale if scale != 1.0 else loss
            if scaler is not None:
                scaled = scaler.scale(scaled)
            torch.autograd.backward(scaled)
        self.timing.backward_done()
        count = len(target)
        assert self._pending_loss is not None
        self._pending_loss.add_(loss.detach(), alpha=count)  # one kernel, float64 sum
        self._pending_samples += count
        self._epoch_samples_here += count

    def _optimizer_step(self) -> None:
        scaler = self.precision.scaler
        if self.spec.grad_clip_norm is not None:
            if scaler is not None:
                scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.spec.grad_clip_norm)
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    # --- after each optimizer step ----------------------------------------------------------

    def _after_step(self) -> None:
        if not self._started:
            self._started = True
            self.metrics.record(MetricRecord(
                "start", epoch=self.position.epoch + 1, step=self.position.step,
                time=time.time(), world_size=self.cluster.world_size,
                resumed_from_step=self.resumed_from, batch_shares=self.shares,
                passed_over=self.passed_over or None,
            ))
        every_log = self.spec.log_every_steps
        if every_log and self.position.step % every_log == 0:
            self._log_step()
        every = self.spec.checkpoint_every_steps
        if every and self.position.step % every == 0:
            self.save(barrier=False)

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _log_step(self) -> None:
        loss_sum, samples = self._running()
        sums = self._all_reduce([loss_sum - self._interval[0], samples - self._interval[1]])
        now = time.perf_counter()
        elapsed = now - self._interval[2]
        self._interval = (loss_sum, float(samples), now)
        self.metrics.record(self._progress(
            "step", train_loss=sums[0] / sums[1] if sums[1] else None,
            samples_per_s=sums[1] / elapsed if elapsed > 0 else None,
        ))

    def _progress(
        self, kind: str, *, train_loss: float | None, samples_per_s: float | None,
        val_loss: float | None = None, val_accuracy: float | None = None,
        epoch_s: float | None = None,
    ) -> MetricRecord:
        """A ``step`` or ``epoch`` record where training is now (every rank computes it: the
        peak memory is gathered from all)."""
        return MetricRecord(
            kind, epoch=self.position.epoch + 1, step=self.position.step, time=time.time(),
            train_loss=train_loss, val_loss=val_loss, val_accuracy=val_accuracy,
            samples_per_s=samples_per_s, epoch_s=epoch_s, lr=self._lr(),
            peak_memory_gb=self._memory(), batch_shares=self.shares,
        )

    def _all_reduce(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.cluster.device)
        if self.cluster.world_size > 1:
            dist.all_reduce(tensor)
        return [float(v) for v in tensor.tolist()]

    def _memory(self) -> tuple[float, ...] | None:
        """Every rank's measured peak memory in GB (:mod:`orchestrate.train.peakmemory`)."""
        if self.peak is None:
            return None
        peak = self.peak.peak_bytes() / GB
        peaks: list[Any] = [None] * self.cluster.world_size
        if self.cluster.control is not None:
            dist.all_gather_object(peaks, peak, group=self.cluster.control)
        else:
            peaks = [peak]
        return tuple(round(p, 3) for p in peaks)

    # --- end of an epoch --------------------------------------------------------------------

    def _close_epoch(self, *, complete: bool) -> None:
        """Validate and report the epoch; when ``complete``, move on to the next one."""
        if self.cluster.device.type == "cuda":
            torch.cuda.synchronize(self.cluster.device)
        train_s = time.perf_counter() - self._epoch_started
        loss_sum, samples = self._running()
        reduced = self._all_reduce([loss_sum, float(samples), float(self._epoch_samples_here)])
        if not math.isfinite(reduced[0]):
            self._nonfinite()
        val_loss = val_accuracy = None
        if self.val_loader is not None:
            sidecar.phase("eval", self.position.step)
            result = evaluate(
                self.model if self.sharded else self.module,
                self.val_loader,
                self.loss_fn,
                self.precision,
                self.cluster.device,
                distributed=self.cluster.world_size > 1,
                lockstep=self.val_set if self.sharded else None,
                control=self.cluster.control,
            )
            val_loss, val_accuracy = result.loss, result.accuracy
            # Out of the slow phase: a rank stuck after it must not count as busy evaluating.
            sidecar.phase("step", self.position.step)
        self.metrics.record(self._progress(
            "epoch", train_loss=reduced[0] / reduced[1] if reduced[1] else None,
            val_loss=val_loss, val_accuracy=val_accuracy,
            samples_per_s=reduced[2] / train_s if train_s > 0 else None,
            epoch_s=time.perf_counter() - self._epoch_started,
        ))
        if complete:
            self.position.epoch += 1
            self.position.batch = 0
            self.totals = EpochTotals()
            self._pending_loss = None
            self._pending_samples = 0
        else:
            self._fold()

    def _fold(self) -> None:
        """Move the running sums from the device into :attr:`totals` (kept in checkpoints)."""
        loss_sum, samples = self._running()
        self.totals = EpochTotals(loss_sum=loss_sum, samples=samples)
        if self._pending_loss is not None:
            self._pending_loss.zero_()
        self._pending_samples = 0

    def _finish(self, outcome: Outcome) -> None:
        self.timing.close()
        if self.rebalancer is not None:
            self.rebalancer.close()
        self.metrics.record(MetricRecord(
            "end", outcome=outcome, signal=self.stop.flag.signal_name,
            epoch=self.position.epoch + (0 if self.position.batch == 0 else 1),
            step=self.position.step, time=time.time(),
        ))
        self.metrics.close()

    # --- a loss that is not a number --------------------------------------------------------

    def loss_not_finite(self) -> bool:
        """Whether this rank's running loss (or any of its weights) went NaN or infinite."""
        return not math.isfinite(self._running()[0])

    def _weights_finite(self) -> bool:
        return sharding.all_finite(self.module)

    def _nonfinite(self) -> None:
        """Every rank arrives here together (the health flag was agreed on, or the reduced loss
        is not finite): name where it happened and stop without writing another checkpoint."""
        mine = self.loss_not_finite() or not self._weights_finite()
        flags: list[Any] = [mine]
        if self.cluster.control is not None:
            flags = [None] * self.cluster.world_size
            dist.all_gather_object(flags, mine, group=self.cluster.control)
        ranks = [rank for rank, bad in enumerate(flags) if bad] or list(range(len(flags)))
        raise NonFiniteLoss(self.position.epoch + 1, self.position.step, ranks,
                            self.checkpoints.last)

    # --- checkpoints ------------------------------------------------------------------------

    def save(self, *, barrier: bool) -> None:
        """Checkpoint the current position (a collective: see
        :meth:`orchestrate.train.saving.Checkpointer.save`)."""
        self.checkpoints.save(self._where, self._checkpoint_state, barrier=barrier)

    def _checkpoint_state(self) -> TrainState:
        """What a checkpoint reads of this rank, the running sums folded in first."""
        self._fold()
        p, totals = self.position, self.totals
        return TrainState(
            spec=self.spec, model=self.model, module=self.module, optimizer=self.optimizer,
            scheduler=self.scheduler, scaler=self.precision.scaler, sharded=self.sharded,
            epoch=p.epoch, batch=p.batch, step=p.step, loss_sum=totals.loss_sum,
            samples=totals.samples, shares=self.shares,
            finite=math.isfinite(totals.loss_sum) and self._weights_finite())
