"""One rank's whole run: join, set up, agree that setup worked everywhere, train, leave.

Setup runs the user's factories and loads checkpoints, which fail in rank-specific ways (a file
one node cannot see, a factory that raises on one rank). Each rank catches its own failure and
then *still* takes part in a small all-gather of outcomes on the control group, so every rank
learns at once that setup failed, where, and why: the failing rank prints its message (once, even
when all ranks failed the same way) and every rank exits promptly instead of waiting in the next
collective. Failures during training cannot be agreed on like that; there the failing rank exits,
its peers' next collective fails because its connections closed, and the finite timeout is the
backstop.

Exit status: 0 done, 1 failed, 2 wrong configuration or environment, 75 stopped by a signal after
checkpointing (requeue me), 130 interrupted.
"""

from __future__ import annotations

import math
import sys
import traceback
from collections.abc import Mapping, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset, IterableDataset

from orchestrate.core.errors import UserError
from orchestrate.core.exits import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REQUEUE,
    EXIT_USER_ERROR,
)
from orchestrate.core.spec.trainspec import TrainSpec
from orchestrate.diagnosis import activation, sidecar
from orchestrate.train import checkpoint, factories, rng
from orchestrate.train.distributed import Cluster, join, leave
from orchestrate.train.env import DistEnv
from orchestrate.train.failure import NonFiniteLoss, TrainFailure
from orchestrate.train.losses import LossFn, resolve_loss
from orchestrate.train.metrics import MetricsLog
from orchestrate.train.optimizer import build_optimizer, build_scheduler
from orchestrate.train.precision import PrecisionPlan, plan_precision
from orchestrate.train.preemption import StopAgreement, StopFlag, signal_names
from orchestrate.train.sampling import ResumableSampler, validation_shard
from orchestrate.train.timing import StepTiming
from orchestrate.train.trainer import EpochTotals, Position, Trainer

_PEER_SIGNS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout")


class SetupAborted(Exception):
    """Setup failed on some rank; every rank stops with :attr:`status`."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


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


# --- user-visible messages -------------------------------------------------------------------


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _is_peer_failure(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return any(sign in text for sign in _PEER_SIGNS)


def _describe(exc: BaseException) -> tuple[str, str, str]:
    """(kind, one-line message, traceback text) of a setup failure."""
    if isinstance(exc, UserError):
        return "user", str(exc), ""
    if isinstance(exc, TrainFailure):
        cause = exc.__cause__
        trace = ""
        if cause is not None and not isinstance(cause, ModuleNotFoundError):
            trace = "".join(traceback.format_exception(cause))
        return "failure", str(exc), trace
    return "failure", f"setup failed: {_first_line(exc)}", "".join(traceback.format_exception(exc))


# --- setup --------------------------------------------------------------------------------


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


def _build(spec: TrainSpec, cluster: Cluster, run_dir: Path) -> Built:
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


def _restore(spec: TrainSpec, cluster: Cluster, built: Built, log: MetricsLog) -> Restored:
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
            f"checkpoint {path}: optimizer state does not fit ({_first_line(exc)}); "
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


def _gather_outcomes(cluster: Cluster, failure: tuple[str, str] | None, payload: Any) -> list[Any]:
    """All ranks' (failure, payload), gathered on the control group."""
    mine = (failure, payload)
    if cluster.control is None:
        return [mine]
    everyone: list[Any] = [None] * cluster.world_size
    dist.all_gather_object(everyone, mine, group=cluster.control)
    return everyone


def _agree_on(
    cluster: Cluster, phase: str, error: BaseException | None, payload: Any = None
) -> list[Any]:
    """Agree that ``phase`` worked on every rank; otherwise report once and stop everyone."""
    described = None if error is None else _describe(error)
    failure = None if described is None else (described[0], described[1])
    try:
        outcomes = _gather_outcomes(cluster, failure, payload)
    except Exception:
        if described is not None:  # peers are gone; still say what went wrong here
            _say(f"rank {cluster.rank}: {described[1]}")
            raise SetupAborted(EXIT_USER_ERROR if described[0] == "user" else EXIT_FAILED) from None
        raise
    failed = [(rank, fail) for rank, (fail, _) in enumerate(outcomes) if fail is not None]
    if not failed:
        return [payload for _, payload in outcomes]
    by_message: dict[str, list[int]] = {}
    for rank, (_, message) in failed:
        by_message.setdefault(message, []).append(rank)
    for message, ranks in by_message.items():
        if ranks[0] != cluster.rank:
            continue
        if described is not None and described[2]:
            _say(described[2].rstrip())
        also = f" (the same on rank(s) {_ranks_text(ranks[1:])})" if len(ranks) > 1 else ""
        _say(f"rank {cluster.rank}: {message}{also}")
    if cluster.rank == 0 and failure is None:
        _say(f"rank 0: stopping: {phase} failed on rank(s) {_ranks_text([r for r, _ in failed])}")
    # A configuration mistake exits 2 on the ranks it hit, and on the others if it is all there is.
    kinds = {failure[0]} if failure is not None else {fail[0] for _, fail in failed}
    raise SetupAborted(EXIT_USER_ERROR if kinds == {"user"} else EXIT_FAILED)


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) > 8:
        return ", ".join(map(str, ranks[:8])) + f" and {len(ranks) - 8} more"
    return ", ".join(map(str, ranks))


def _setup(
    spec: TrainSpec, cluster: Cluster, run_dir: Path, flag: StopFlag, log: MetricsLog,
    environ: Mapping[str, str],
) -> Trainer:
    built: Built | None = None
    error: BaseException | None = None
    try:
        built = _build(spec, cluster, run_dir)
    except Exception as exc:
        error = exc
    payloads = _agree_on(
        cluster, "setup", error, None if built is None else built.resume_from
    )
    assert built is not None
    built.resume_from = payloads[0]
    restored = Restored()
    try:
        restored = _restore(spec, cluster, built, log)
    except Exception as exc:
        error = exc
    _agree_on(cluster, "loading the checkpoint", error)

    cuda = cluster.device.type == "cuda"
    model = DistributedDataParallel(
        built.module,
        device_ids=[cluster.device.index] if cuda else None,
        gradient_as_bucket_view=spec.gradient_as_bucket_view,
        find_unused_parameters=spec.find_unused_parameters,
        bucket_cap_mb=spec.bucket_cap_mb,
    )
    sampler = ResumableSampler(
        built.train_set, num_replicas=cluster.world_size, rank=cluster.rank, seed=spec.seed
    )
    generator = torch.Generator()
    train_loader: DataLoader[Any] = DataLoader(
        built.train_set,
        batch_size=spec.batch_size,
        sampler=sampler,
        num_workers=spec.num_workers,
        pin_memory=cuda,
        generator=generator,
    )
    val_loader: DataLoader[Any] | None = None
    if built.val_set is not None:
        val_loader = DataLoader(
            validation_shard(built.val_set, cluster.rank, cluster.world_size),
            batch_size=spec.batch_size,
            shuffle=False,
            num_workers=spec.num_workers,
            pin_memory=cuda,
            generator=torch.Generator(),  # never draw from the global RNG (resume exactness)
        )
    trainer = Trainer(
        spec=spec,
        cluster=cluster,
        model=model,
        optimizer=built.optimizer,
        scheduler=built.scheduler,
        precision=built.precision,
        loss_fn=built.loss_fn,
        sampler=sampler,
        train_loader=train_loader,
        loader_generator=generator,
        val_loader=val_loader,
        stop=StopAgreement(flag, cluster.control),
        metrics=log,
        checkpoint_dir=built.checkpoint_dir,
        position=restored.position,
        totals=restored.totals,
        resumed_from=restored.resumed_from,
        timing=StepTiming.for_rank(run_dir, cluster.rank, cuda=cuda, environ=environ),
    )
    trainer.stop.unhealthy = trainer.loss_not_finite
    trainer.last_checkpoint = built.resume_from
    _announce(spec, cluster, built, restored, log)
    if restored.resumed_from is not None:
        p = restored.position
        trainer.last_saved = (p.epoch, p.batch, p.step)
    return trainer


def _announce(
    spec: TrainSpec, cluster: Cluster, built: Built, restored: Restored, log: MetricsLog
) -> None:
    params = sum(p.numel() for p in built.module.parameters())
    val = len(built.val_set) if isinstance(built.val_set, Sized) else 0
    log.say(
        f"orchestrate.train: {cluster.world_size} rank(s), {cluster.backend} on "
        f"{cluster.device.type}, {params:,} parameters, {len(built.train_set)} training / "  # type: ignore[arg-type]
        f"{val} validation samples, {built.steps_per_epoch} steps per epoch, "
        f"precision {spec.precision}"
    )
    if built.resume_from is not None:
        p = restored.position
        log.say(f"resuming from {built.resume_from} (epoch {p.epoch + 1}, step {p.step})")


# --- the run ----------------------------------------------------------------------------


def run_session(
    spec: TrainSpec, env: DistEnv, run_dir: Path, environ: Mapping[str, str]
) -> int:
    """Run this rank to the end; returns the process exit status."""
    flag = StopFlag()
    flag.install(signal_names(spec.stop_signals))
    cluster: Cluster | None = None
    trainer: Trainer | None = None
    if activation.enabled(environ):  # heartbeats for the launcher's stall watch
        sidecar.start(run_dir, env.rank)
    try:
        try:
            sidecar.phase("init_process_group")
            cluster = join(env, environ)
        except UserError as err:
            _say(f"rank {env.rank}: {err}")
            return EXIT_USER_ERROR
        except Exception as exc:
            _say(
                f"rank {env.rank}: could not join the process group at "
                f"{env.master_addr}:{env.master_port} ({env.world_size} ranks): {_first_line(exc)}"
            )
            leave(None, failed=True)
            return EXIT_FAILED
        sidecar.phase("setup")
        run_dir.mkdir(parents=True, exist_ok=True)
        log = MetricsLog(run_dir, spec, enabled=cluster.rank == 0)
        trainer = _setup(spec, cluster, run_dir, flag, log, environ)
        outcome = trainer.run()
        leave(cluster, failed=False)
        if outcome == "preempted":
            log.say(
                f"stopped by {flag.signal_name or 'a signal'} at step {trainer.position.step}; "
                f"checkpointed, exiting {EXIT_REQUEUE} to be requeued"
            )
            return EXIT_REQUEUE
        return EXIT_OK
    except SetupAborted as aborted:
        leave(cluster, failed=True)
        return aborted.status
    except KeyboardInterrupt:
        _say(f"rank {env.rank}: interrupted")
        leave(cluster, failed=True)
        return EXIT_INTERRUPTED
    except NonFiniteLoss as exc:
        # Every rank stops at once (they agreed); one sentence, from rank 0.
        if env.rank == 0:
            _say(f"rank {env.rank}: {exc}")
        leave(cluster, failed=True)
        return EXIT_FAILED
    except Exception as exc:
        where = "setup failed"
        if trainer is not None:
            p = trainer.position
            where = f"training failed in epoch {p.epoch + 1} after step {p.step}"
        if _is_peer_failure(exc):
            _say(
                f"rank {env.rank}: {where}: {_first_line(exc)} (a collective failed: another "
                "rank probably failed first; look for its message)"
            )
        else:
            _say(traceback.format_exc().rstrip())
            _say(f"rank {env.rank}: {where}: {_first_line(exc)}")
        leave(cluster, failed=True)
        return EXIT_FAILED
    finally:
        flag.uninstall()
        sys.stdout.flush()
        sys.stderr.flush()
