"""Taking a checkpoint of a training run: what it holds, and who writes it.

Every rank sends its RNG states and running loss to rank 0 (on the control group), and every
rank says whether its weights are finite: a checkpoint of NaN weights would rotate the last good
ones out, so then nothing is written and training stops. Under DDP rank 0 alone writes one file
(:func:`orchestrate.train.checkpoint.save`); under FSDP every rank writes its shards into one
folder and rank 0 adds the rest (:mod:`orchestrate.train.distcp`). The layout of what is kept
is in docs/train.md ("Checkpoints").
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from orchestrate.core.metricrecord import MetricRecord
from orchestrate.diagnosis import sidecar
from orchestrate.train import checkpoint, rng
from orchestrate.train.failure import NonFiniteLoss

if TYPE_CHECKING:
    from orchestrate.train.trainer import Trainer


def _gather(trainer: Trainer) -> list[Any]:
    """Every rank's part of the checkpoint, in rank order."""
    mine = {
        "rng": rng.capture(trainer.cluster.device.type == "cuda"),
        "train_loss_sum": trainer.totals.loss_sum,
        "train_samples": trainer.totals.samples,
        # Never a checkpoint of NaN weights: it would rotate the last good ones out.
        "finite": math.isfinite(trainer.totals.loss_sum) and trainer._weights_finite(),
        "pid": os.getpid(),
    }
    ranks: list[Any] = [None] * trainer.cluster.world_size
    if trainer.cluster.control is not None:
        dist.all_gather_object(ranks, mine, group=trainer.cluster.control)
    else:
        ranks = [mine]
    return ranks


def _side_state(trainer: Trainer, ranks: list[Any]) -> dict[str, Any]:
    """Everything but the model and the optimizer: the schedule, the position, the ranks."""
    spec, p = trainer.spec, trainer.position
    scaler = trainer.precision.scaler
    return {
        "format": checkpoint.FORMAT,
        "scheduler": None if trainer.scheduler is None else trainer.scheduler.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
        "epoch": p.epoch,
        "batch_in_epoch": p.batch,
        "step": p.step,
        "world_size": trainer.cluster.world_size,
        "batch_size": spec.batch_size,
        "batch_shares": None if trainer.shares is None else list(trainer.shares),
        "strategy": "fsdp" if trainer.sharded else "ddp",
        "sampler": {"epoch": p.epoch, "seed": spec.seed,
                    "samples_done_per_rank": p.batch * spec.batch_size},
        "ranks": ranks,
        "config": spec.model_dump(mode="json"),
        "time": time.time(),
    }


def save(trainer: Trainer, *, barrier: bool) -> None:
    """Checkpoint the trainer's position (a collective on every rank).

    With ``barrier`` no rank returns before the checkpoint is on disk: after a stop signal a
    launcher may kill every rank as soon as one of them exits.
    """
    control = trainer.cluster.control
    if trainer.last_saved == trainer._where:  # e.g. a periodic checkpoint at the stop step
        if barrier and control is not None:
            dist.barrier(group=control)
        return
    sidecar.phase("checkpoint", trainer.position.step)
    trainer._fold()
    ranks = _gather(trainer)
    bad = [rank for rank, state in enumerate(ranks) if not state.pop("finite")]
    if bad:
        raise NonFiniteLoss(trainer.position.epoch + 1, trainer.position.step, bad,
                            trainer.last_checkpoint)
    tag = int(ranks[0].pop("pid"))
    for state in ranks:
        state.pop("pid", None)
    side = _side_state(trainer, ranks) if trainer.cluster.rank == 0 else {}
    spec = trainer.spec
    if trainer.sharded:
        from orchestrate.train import distcp

        path = distcp.save(trainer.model, trainer.optimizer, side,
                           directory=trainer.checkpoint_dir, step=trainer.position.step,
                           keep=spec.keep_checkpoints, rank=trainer.cluster.rank, tag=tag,
                           group=control)
    elif trainer.cluster.rank == 0:
        state = {**side, "model": trainer.module.state_dict(),
                 "optimizer": trainer.optimizer.state_dict()}
        path = checkpoint.save(state, trainer.checkpoint_dir, trainer.position.step,
                               spec.keep_checkpoints)
    else:
        path = None
    if path is not None:
        _announce(trainer, path)
    if barrier and control is not None:
        dist.barrier(group=control)
    trainer.last_saved = trainer._where
    # Out of the slow phase: a rank stuck after it (in its data) must not count as busy
    # checkpointing (docs/hangs.md, distributed.busy_s).
    sidecar.phase("step", trainer.position.step)


def _announce(trainer: Trainer, path: Any) -> None:
    p = trainer.position
    trainer.last_checkpoint = path
    trainer.metrics.say(f"checkpoint {path} (epoch {p.epoch + 1}, step {p.step})")
    done = p.epoch + (0 if p.batch == 0 else 1)
    trainer.metrics.record(MetricRecord("checkpoint", epoch=done, step=p.step,
                                        time=time.time(), path=str(path)))
