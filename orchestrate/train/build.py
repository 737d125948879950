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

from orchestrate.core.errors import UserError
from orchestrate.core.spec.trainspec import TrainSpec
from orchestrate.train import batchshares, checkpoint, factories, rng, sharding
from orchestrate.train.distributed import Cluster
from orchestrate.train.failure import TrainFailure, first_line
from orchestrate.train.losses import LossFn, resolve_loss
from orchestrate.train.metrics import MetricsLog
from orchestrate.train.optimizer import build_optimizer, build_scheduler
from orchestrate.train.peakmemory import PeakMemory
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
    peak: PeakMemory | None = None
    notes: list[str] = field(default_factory=list)  # for people, from rank 0
    #: Newer checkpoints rank 0 passed over for ``resume_from`` (not whole), and why.
    passed_over: list[str] = field(default_factory=list)
    #: FSDP's init_from on rank 0: the weights to broadcast (read in setup's first phase, so
    #: that a file rank 0 cannot read stops every rank before the broadcast).
    init_weights: dict[str, Any] | None = None


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
    if spec.global_batch_size is not None:  # every rank: its share of each global batch
        micro = max(1, spec.global_batch_size // spec.grad_accum_steps)
        per_rank = len(train_set) // micro * spec.batch_size  # type: ignore[arg-type]
    if per_rank == 0:
        raise _too_small(spec, len(train_set), cluster.world_size)  # type: ignore[arg-type]
    peak = PeakMemory(cluster.device)
    peak.start()  # the measured peak counts from here: the model and everything after it
    precision = plan_precision(spec, cluster.device)
    module, notes = _model(spec, cluster, precision.param_dtype)
    trainable = [p for p in module.parameters() if p.requires_grad]
    loss_fn = resolve_loss(spec.loss)
    optimizer = build_optimizer(spec.optimizer, trainable)  # after sharding: DTensor shards
    steps_per_epoch = math.ceil(math.ceil(per_rank / spec.batch_size) / spec.grad_accum_steps)
    total = spec.epochs * steps_per_epoch
    if spec.max_steps is not None:
        total = min(total, spec.max_steps)
    scheduler = build_scheduler(spec.scheduler, optimizer, total)
    directory = checkpoint_dir_for(spec, run_dir)
    built = Built(
        train_set, val_set, module, loss_fn, precision, optimizer, scheduler, steps_per_epoch,
        directory, peak=peak, notes=notes,
    )
    if cluster.rank == 0:
        checkpoint.clean_temporaries(directory)
        skipped = built.passed_over
        built.resume_from = checkpoint.find_latest(directory, skipped)
        built.notes.extend(
            f"checkpoint {why}: resuming from the newest complete one instead "
            f"({built.resume_from.name if built.resume_from else 'none: starting over'})"
            for why in skipped)
        if built.resume_from is None and spec.init_from is not None and spec.sharded:
            source = Path(spec.init_from).expanduser()
            built.init_weights, more = sharding.weights_for(module, source,
                                                            f"init_from {source}")
            built.notes.extend(f"init_from {source}: {n} (loaded the rest)" for n in more)
    return built


def _too_small(spec: TrainSpec, samples: int, world: int) -> Exception:
    """A training set with no step in it: fewer samples than one global batch (a
    configuration mistake: exit 2), or than the ranks."""
    if spec.global_batch_size is not None and samples >= world:
        return UserError.single(
            f"the training set has {samples} samples, fewer than one global batch "
            f"({spec.global_batch_size} samples per optimizer step over all ranks): not one "
            "step per epoch", field="train.global_batch_size", got=spec.global_batch_size,
            hint=f"set global_batch_size to at most {samples}, or give a larger dataset")
    return TrainFailure(f"dataset factory {spec.dataset}: the training set has {samples} "
                        f"samples, fewer than the {world} ranks")


def _made(spec: TrainSpec) -> torch.nn.Module:
    """The seeded model factory's model (every rank builds the same one)."""
    rng.seed_all(spec.seed)
    module = factories.call(spec.model, "model factory", dict(spec.model_args))
    if not isinstance(module, torch.nn.Module):
        raise TrainFailure(
            f"model factory {spec.model} returned {type(module).__name__}, not a torch.nn.Module"
        )
    if not any(p.requires_grad for p in module.parameters()):
        raise TrainFailure(f"model factory {spec.model}: the model has no trainable parameters")
    return module


def _model(spec: TrainSpec, cluster: Cluster, dtype: torch.dtype
           ) -> tuple[torch.nn.Module, list[str]]:
    """The rank's model on its device: a whole replica (DDP wraps it later), or its shards."""
    if spec.sharded:
        return sharding.build_sharded(spec, lambda: _made(spec), rank=cluster.rank,
                                      world=cluster.world_size, device=cluster.device,
                                      dtype=dtype)
    module = _made(spec)
    checkpointed = sharding.checkpointed(module, spec, [])
    sharding.apply_checkpointing(checkpointed)
    if dtype != torch.float32:
        module.to(device=cluster.device, dtype=dtype)
    else:
        module.to(device=cluster.device)
    notes = [f"activation checkpointing: {len(checkpointed)} modules "
             f"({', '.join(sorted({type(m).__name__ for m in checkpointed}))})"
             ] if checkpointed else []
    return module, notes


def restore(spec: TrainSpec, cluster: Cluster, built: Built, log: MetricsLog) -> Restored:
    """Resume from ``built.resume_from``, else start from ``init_from``, else from scratch."""
    restored = Restored()
    path = built.resume_from
    rng.seed_all(rng.rank_seed(spec.seed, cluster.rank))
    if path is None:
        if spec.init_from is not None:
            _init_from(spec, cluster, built, log)
        return restored
    state = _resume_state(spec, cluster, built, path)
    for key in ("epoch", "batch_in_epoch", "step", "ranks"):
        if key not in state:
            raise TrainFailure(f"checkpoint {path} has no {key!r}; not written by orchestrate")
    try:
        if built.scheduler is not None and state.get("scheduler") is not None:
            built.scheduler.load_state_dict(state["scheduler"])
        scaler = built.precision.scaler
        if scaler is not None and state.get("scaler") is not None:
            scaler.load_state_dict(state["scaler"])
    except (ValueError, KeyError, RuntimeError) as exc:
        raise TrainFailure(f"checkpoint {path}: the schedule's state does not fit "
                           f"({first_line(exc)})") from exc
    position = Position(int(state["epoch"]), int(state["batch_in_epoch"]), int(state["step"]))
    ranks: list[Any] = list(state["ranks"])
    # Under shares a batch is one global batch whatever the split (measured shares change
    # during a run), so the position is exact when the global batch is the same size.
    saved_shares = state.get("batch_shares") or []
    shares = batchshares.shares_of(spec, cluster.world_size) or []
    saved_global = (sum(saved_shares) if saved_shares
                    else int(state.get("batch_size", -1)) * int(state.get("world_size", -1)))
    now_global = sum(shares) if shares else spec.batch_size * cluster.world_size
    same_layout = int(state.get("world_size", -1)) == cluster.world_size and (
        saved_global == now_global if shares and saved_shares
        else not shares and not saved_shares
        and int(state.get("batch_size", -1)) == spec.batch_size)
    if not same_layout and position.batch:
        batch = position.batch * saved_global // now_global
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


def _resume_state(spec: TrainSpec, cluster: Cluster, built: Built, path: Path
                  ) -> dict[str, Any]:
    """Load the model and optimizer of the checkpoint to resume from; returns the rest of it.
    A sharded checkpoint (a folder) resumes FSDP on any world size, a file resumes DDP."""
    if checkpoint.is_sharded(path) != spec.sharded:
        wrote, runs = ("fsdp", "ddp") if path.is_dir() else ("ddp", "fsdp")
        raise TrainFailure(
            f"checkpoint {path} was written under strategy {wrote} and this run is {runs}: "
            "resume with the strategy that wrote it, or start from its weights with init_from "
            f"(or orchestrate export) in a new job")
    if spec.sharded:
        from orchestrate.train import distcp

        return distcp.restore(built.module, built.optimizer, path, cluster.control)
    state = checkpoint.load(path)
    for key in ("model", "optimizer"):
        if key not in state:
            raise TrainFailure(f"checkpoint {path} has no {key!r}; not written by orchestrate")
    checkpoint.load_model_state(
        built.module, state["model"], strict=True, source=f"checkpoint {path}"
    )
    try:
        built.optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError, RuntimeError) as exc:
        raise TrainFailure(
            f"checkpoint {path}: optimizer state does not fit ({first_line(exc)}); "
            "was the optimizer or the model changed?"
        ) from exc
    return state


def _init_from(spec: TrainSpec, cluster: Cluster, built: Built, log: MetricsLog) -> None:
    """Load ``init_from`` (a state-dict file or a sharded checkpoint, either strategy's):
    every rank under DDP; under FSDP rank 0 reads it and broadcasts it into the shards."""
    assert spec.init_from is not None
    source = Path(spec.init_from).expanduser()
    where = f"init_from {source}"
    if not spec.sharded:
        loaded = checkpoint.load(source)
        notes = checkpoint.load_model_state(
            built.module, checkpoint.model_state_of(loaded), strict=False, source=where)
        for note in notes:
            log.say(f"{where}: {note} (loaded the rest)")
    else:  # rank 0 read and checked them in setup's first phase (its notes are said there)
        sharding.broadcast_weights(built.module, built.init_weights)
        built.init_weights = None
