"""Setup on one rank: the user's factories, the model, optimizer and schedule, and where
training starts (a checkpoint to resume from, ``init_from``, or scratch).

Everything here is local to the rank and may fail in rank-specific ways (a file one node cannot
see, a factory that raises on one rank); :mod:`orchestrate.train.session` has every rank agree
that it worked before training starts.
"""

from __future__ import annotations

import math
from collections.abc import Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import Dataset, IterableDataset

from orchestrate.core.spec.trainspec import TrainSpec
from orchestrate.train import checkpoint, factories, rng
from orchestrate.train.distributed import Cluster
from orchestrate.train.failure import TrainFailure, first_line
from orchestrate.train.losses import LossFn, resolve_loss
from orchestrate.train.metrics import MetricsLog
from orchestrate.train.optimizer import build_optimizer, build_scheduler
from orchestrate.train.precision import PrecisionPlan, plan_precision
from orchestrate.train.trainer import EpochTotals, Position


@dataclass
class Built:
    """What setup made from the job file and the user's factories."""

    train_set: Dataset[Any]
    val_set: Dataset[Any] | None
    module: torch.nn.Module
    loss_fn: LossFn
    precision: PrecisionPlan
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR | None
    steps_per_epoch: int
    checkpoint_dir: Path
    resume_from: Path | None = None  # rank 0's finding; shared with all ranks by the agreement


@dataclass
class Restored:
    """Where training starts after loading a checkpoint (or not)."""

    position: Position = field(default_factory=Position)
    totals: EpochTotals = field(default_factory=EpochTotals)
    resumed_from: int | None = None


def checkpoint_dir_for(spec: TrainSpec, run_dir: Path) -> Path:
    """``checkpoint_dir`` resolved against the run dir (default ``<run_dir>/checkpoints``)."""
    if spec.checkpoint_dir is None:
        return run_dir / "checkpoints"
    path = Path(spec.checkpoint_dir).expanduser()
    return path if path.is_absolute() else run_dir / path


def _datasets(spec: TrainSpec, made: Any) -> tuple[Dataset[Any], Dataset[Any] | None]:
    where = f"dataset factory {spec.dataset}"
    if not isinstance(made, tuple | list) or len(made) != 2:
        raise TrainFailure(
            f"{where} returned {type(made).__name__}; it must return "
            "(train_dataset, val_dataset or None)"
        )
    train_set, val_set = made
    for name, data in (("training", train_set), ("validation", val_set)):
        if data is None and name == "validation":
            continue
        if isinstance(data, IterableDataset) or not isinstance(data, Sized):
            raise TrainFailure(
                f"{where}: the {name} dataset must be map-style (len() and [index]) so "
                "DistributedSampler can shard it"
            )
    return train_set, val_set


def build(spec: TrainSpec, cluster: Cluster, run_dir: Path) -> Built:
    """Run the factories and make the optimizer; everything here is local to the rank."""
    rng.seed_all(spec.seed)  # same seed on every rank: identical splits and initial weights
    train_set, val_set = _datasets(
        spec, factories.call(spec.dataset, "dataset factory", dict(spec.dataset_args))
    )
    per_rank = len(train_set) // cluster.world_size  # type: ignore[arg-type]
    if per_rank == 0:
        raise TrainFailure(
            f"dataset factory {spec.dataset}: the training set has "
            f"{len(train_set)} samples, fewer than the {cluster.world_size} ranks"  # type: ignore[arg-type]
        )
    rng.seed_all(spec.seed)
    module = factories.call(spec.model, "model factory", dict(spec.model_args))
    if not isinstance(module, torch.nn.Module):
        raise TrainFailure(
            f"model factory {spec.model} returned {type(module).__name__}, not a torch.nn.Module"
        )
    trainable = [p for p in module.parameters() if p.requires_grad]
    if not trainable:
        raise TrainFailure(f"model factory {spec.model}: the model has no trainable parameters")
    loss_fn = resolve_loss(spec.loss)
    precision = plan_precision(spec, cluster.device)
    if precision.param_dtype != torch.float32:
        module.to(device=cluster.device, dtype=precision.param_dtype)
    else:
        module.to(device=cluster.device)
    optimizer = build_optimizer(spec.optimizer, trainable)
    steps_per_epoch = math.ceil(math.ceil(per_rank / spec.batch_size) / spec.grad_accum_steps)
    total = spec.epochs * steps_per_epoch
    if spec.max_steps is not None:
        total = min(total, spec.max_steps)
    scheduler = build_scheduler(spec.scheduler, optimizer, total)
    directory = checkpoint_dir_for(spec, run_dir)
    built = Built(
        train_set, val_set, module, loss_fn, precision, optimizer, scheduler, steps_per_epoch,
        directory,
    )
    if cluster.rank == 0:
        checkpoint.clean_temporaries(directory)
        built.resume_from = checkpoint.find_latest(directory)
    return built


def restore(spec: TrainSpec, cluster: Cluster, built: Built, log: MetricsLog) -> Restored:
    """Resume from ``built.resume_from``, else start from ``init_from``, else from scratch."""
    restored = Restored()
    path = built.resume_from
    rng.seed_all(rng.rank_seed(spec.seed, cluster.rank))
    if path is None:
        if spec.init_from is not None:
            source = Path(spec.init_from).expanduser()
            loaded = checkpoint.load(source)
            notes = checkpoint.load_model_state(
                built.module, checkpoint.model_state_of(loaded), strict=False,
                source=f"init_from {source}",
            )
            for note in notes:
                log.say(f"init_from {source}: {note} (loaded the rest)")
        return restored
    state = checkpoint.load(path)
    for key in ("model", "optimizer", "epoch", "batch_in_epoch", "step", "ranks"):
        if key not in state:
            raise TrainFailure(f"checkpoint {path} has no {key!r}; not written by orchestrate")
    checkpoint.load_model_state(
        built.module, state["model"], strict=True, source=f"checkpoint {path}"
    )
    try:
        built.optimizer.load_state_dict(state["optimizer"])
        if built.scheduler is not None and state.get("scheduler") is not None:
            built.scheduler.load_state_dict(state["scheduler"])
        scaler = built.precision.scaler
        if scaler is not None and state.get("scaler") is not None:
            scaler.load_state_dict(state["scaler"])
    except (ValueError, KeyError, RuntimeError) as exc:
        raise TrainFailure(
            f"checkpoint {path}: optimizer state does not fit ({first_line(exc)}); "
            "was the optimizer or the model changed?"
        ) from exc
    position = Position(int(state["epoch"]), int(state["batch_in_epoch"]), int(state["step"]))
    ranks: list[Any] = list(state["ranks"])
    same_layout = (
        int(state.get("world_size", -1)) == cluster.world_size
        and int(state.get("batch_size", -1)) == spec.batch_size
    )
    if not same_layout and position.batch:
        done = position.batch * int(state["batch_size"]) * int(state["world_size"])
        batch = done // (spec.batch_size * cluster.world_size)
        position.batch = batch - batch % spec.grad_accum_steps
        log.say(
            f"resume: world size or batch size changed since {path.name}; the interrupted "
            "epoch continues at about the same sample, not the exact one"
        )
    if same_layout and cluster.rank < len(ranks):
        mine = ranks[cluster.rank]
        rng.restore(mine["rng"])
        restored.totals = EpochTotals(float(mine["train_loss_sum"]), int(mine["train_samples"]))
    restored.position = position
    restored.resumed_from = position.step
    return restored
