"""One rank's whole run: join, set up, agree that setup worked everywhere, train, leave.

Setup runs the user's factories and loads checkpoints, which fail in rank-specific ways (a file
one node cannot see, a factory that raises on one rank). Each rank catches its own failure and
then *still* takes part in a small all-gather of outcomes on the control group, so every rank
learns at once that setup failed, where, and why: the failing rank prints its message (once, even
when all ranks failed the same way) and every rank exits promptly instead of waiting in the next
collective. Failures during training cannot be agreed on like that; there the failing rank exits,
its peers' next collective fails because its connections closed, and the finite timeout is the
backstop.

What setup makes on each rank (the factories, the optimizer, the checkpoint to resume from) is
:mod:`orchestrate.train.build`; this module is the agreement around it and the run's lifecycle.

Exit status: 0 done, 1 failed, 2 wrong configuration or environment, 75 stopped by a signal after
checkpointing (requeue me), 130 interrupted.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Mapping, Sized
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

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
from orchestrate.train import batchshares, partwrite, rebalance
from orchestrate.train.batchshares import SharedBatchSampler
from orchestrate.train.build import Built, Restored, build, restore
from orchestrate.train.distributed import Cluster, join, leave
from orchestrate.train.env import DistEnv
from orchestrate.train.failure import AgreedStop, TrainFailure, first_line
from orchestrate.train.metrics import MetricsLog
from orchestrate.train.preemption import StopAgreement, StopFlag, signal_names
from orchestrate.train.sampling import ResumableSampler, validation_shard
from orchestrate.train.saving import Checkpointer
from orchestrate.train.timing import StepTiming
from orchestrate.train.trainer import Trainer
from orchestrate.train.zerogradient import ZeroGradientWatch

_PEER_SIGNS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout")


class SetupAborted(Exception):
    """Setup failed on some rank; every rank stops with :attr:`status`."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


# --- user-visible messages -------------------------------------------------------------------


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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
    return "failure", f"setup failed: {first_line(exc)}", "".join(traceback.format_exception(exc))


# --- setup --------------------------------------------------------------------------------


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
        first, newline, hint = message.partition("\n")  # a UserError's hint: after the line
        _say(f"rank {cluster.rank}: {first}{also}{newline}{hint}")
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
    spec, share = batchshares.for_rank(spec, cluster.rank, cluster.world_size)
    built, restored = _built_everywhere(spec, cluster, run_dir, log)
    cuda = cluster.device.type == "cuda"
    model: torch.nn.Module = built.module  # sharded in place under FSDP
    if not spec.sharded:
        model = DistributedDataParallel(
            built.module,
            device_ids=[cluster.device.index] if cuda else None,
            gradient_as_bucket_view=spec.gradient_as_bucket_view,
            find_unused_parameters=spec.find_unused_parameters,
            bucket_cap_mb=spec.bucket_cap_mb,
        )
    loaders = _loaders(spec, cluster, built, share)
    trainer = Trainer(
        spec=spec,
        cluster=cluster,
        model=model,
        optimizer=built.optimizer,
        scheduler=built.scheduler,
        precision=built.precision,
        loss_fn=built.loss_fn,
        sampler=loaders.sampler,
        train_loader=loaders.train,
        loader_generator=loaders.generator,
        val_loader=loaders.val,
        stop=StopAgreement(flag, cluster.control),
        metrics=log,
        checkpoints=_checkpointer(spec, cluster, built, restored, log),
        position=restored.position,
        totals=restored.totals,
        resumed_from=restored.resumed_from,
        passed_over=tuple(built.passed_over),
        timing=StepTiming.for_rank(run_dir, cluster.rank, cuda=cuda, environ=environ),
        peak=built.peak,
        val_set=built.val_set,
        loss_scale=1.0 if share is None else share.loss_scale,
        shares=None if share is None else share.shares,
        rebalancer=_rebalancer(spec, cluster, model, built.module, share),
    )
    trainer.stop.unhealthy = trainer.loss_not_finite
    ZeroGradientWatch(built.module, cluster, spec.sharded).install(built.optimizer)
    log.open_trackers(environ, restored.resumed_from)
    _announce(spec, cluster, built, restored, log)
    if share is not None:
        _say_shares(spec, share, trainer.rebalancer is not None, log)
    return trainer


def _checkpointer(spec: TrainSpec, cluster: Cluster, built: Built,
                  restored: Restored, log: MetricsLog) -> Checkpointer:
    """Where this run's checkpoints go; a resumed run's position is checkpointed already.
    Background saves on more than one rank (FSDP's shards; DDP's shares among the ranks that
    see rank 0's checkpoint directory, train/partwrite.py) get a gloo group of their own
    (created here, on every rank in the same order): the writing thread's collectives must not
    interleave with the training thread's on the control group."""
    p = restored.position
    group = None
    sharers: tuple[int, ...] = (0,)
    timeout = timedelta(seconds=cluster.timeout_s)
    if spec.checkpoint_async and cluster.control is not None:
        if spec.sharded:
            group = dist.new_group(backend="gloo", timeout=timeout)
        else:
            sharers = partwrite.sharers(cluster.control, cluster.rank, cluster.world_size,
                                        built.checkpoint_dir)
            if len(sharers) > 1:
                group = dist.new_group(ranks=list(sharers), backend="gloo", timeout=timeout)
    return Checkpointer(cluster, built.checkpoint_dir, spec.keep_checkpoints, log,
                        last_saved=None if restored.resumed_from is None
                        else (p.epoch, p.batch, p.step),
                        last=built.resume_from,
                        asynchronous=None if spec.checkpoint_async else False, group=group,
                        sharers=sharers)


def _say_shares(spec: TrainSpec, share: batchshares.RankBatch, measuring: bool,
                log: MetricsLog) -> None:
    """The split on start, and whether measuring will set it (and why not under FSDP)."""
    log.say(f"batch shares {list(share.shares)} of global_batch_size {spec.global_batch_size} "
            "(each rank's loss scaled by its share x world / global batch)")
    if spec.batch_split == "measured" and spec.sharded:
        log.say("batch_split measured under FSDP (strategy auto chose it): the planned "
                "shares stay for the whole run (measuring needs DDP's gradient buckets)")
    if measuring:
        log.say(f"batch_split measured: the shares are set from each rank's own time "
                f"per sample after {rebalance.WARMUP_STEPS} + {spec.batch_measure_steps} "
                "steps" + (", and again every epoch" if spec.batch_rebalance == "epoch"
                           else ""))


def _rebalancer(spec: TrainSpec, cluster: Cluster, model: torch.nn.Module,
                inner: torch.nn.Module, share: batchshares.RankBatch | None
                ) -> rebalance.Rebalancer | None:
    """The measuring of ``batch_split: measured`` (DDP with more than one rank), else None."""
    if (share is None or spec.batch_split != "measured" or spec.batch_shares is not None
            or cluster.world_size < 2 or spec.sharded):
        return None
    caps = spec.batch_plan.caps if spec.batch_plan is not None else []
    return rebalance.Rebalancer(
        model, inner, shares=share.shares, caps=caps, micro_steps=spec.grad_accum_steps,
        measure_steps=spec.batch_measure_steps, every_epoch=spec.batch_rebalance == "epoch",
        control=cluster.control, cuda=cluster.device.type == "cuda")


def _built_everywhere(spec: TrainSpec, cluster: Cluster, run_dir: Path, log: MetricsLog
                      ) -> tuple[Built, Restored]:
    """Build and restore on this rank, agreeing after each that it worked on every rank (rank
    0's checkpoint to resume from goes to all)."""
    built: Built | None = None
    error: BaseException | None = None
    try:
        built = build(spec, cluster, run_dir)
    except Exception as exc:
        error = exc
    payloads = _agree_on(
        cluster, "setup", error, None if built is None else built.resume_from
    )
    assert built is not None
    built.resume_from = payloads[0]
    restored = Restored()
    try:
        restored = restore(spec, cluster, built, log)
    except Exception as exc:
        error = exc
    _agree_on(cluster, "loading the checkpoint", error)
    return built, restored


@dataclass
class Loaders:
    """The rank's resumable sampler and data loaders (and the generator they draw from)."""

    sampler: ResumableSampler | SharedBatchSampler
    generator: torch.Generator
    train: DataLoader[Any]
    val: DataLoader[Any] | None


def _loaders(spec: TrainSpec, cluster: Cluster, built: Built,
             share: batchshares.RankBatch | None) -> Loaders:
    cuda = cluster.device.type == "cuda"
    sampler: ResumableSampler | SharedBatchSampler = ResumableSampler(
        built.train_set, num_replicas=cluster.world_size, rank=cluster.rank, seed=spec.seed
    ) if share is None else SharedBatchSampler(built.train_set, share, seed=spec.seed)
    generator = torch.Generator()
    # Under shares the sampler yields whole batches (its share may change between steps).
    batching: dict[str, Any] = (
        {"batch_sampler": sampler} if isinstance(sampler, SharedBatchSampler)
        else {"batch_size": spec.batch_size, "sampler": sampler})
    train_loader: DataLoader[Any] = DataLoader(
        built.train_set,
        num_workers=spec.num_workers,
        pin_memory=cuda,
        generator=generator,
        **batching,
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
    return Loaders(sampler, generator, train_loader, val_loader)


def _announce(
    spec: TrainSpec, cluster: Cluster, built: Built, restored: Restored, log: MetricsLog
) -> None:
    params = sum(p.numel() for p in built.module.parameters())
    val = len(built.val_set) if isinstance(built.val_set, Sized) else 0
    log.say(
        f"orchestrate.train: {cluster.world_size} rank(s), {cluster.backend} on "
        f"{cluster.device.type}, {params:,} parameters, {len(built.train_set)} training / "  # type: ignore[arg-type]
        f"{val} validation samples, {built.steps_per_epoch} steps per epoch, "
        f"precision {spec.precision}, strategy {spec.strategy}"
    )
    for note in built.notes:
        log.say(note)
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
    got = _Reached()
    if activation.enabled(environ):  # heartbeats for the launcher's stall watch
        sidecar.start(run_dir, env.rank)
    try:
        return _run(spec, env, run_dir, environ, flag, got)
    except SetupAborted as aborted:
        _leave_after_failure(got, aborted)
        return aborted.status
    except KeyboardInterrupt as interrupt:
        _say(f"rank {env.rank}: interrupted")
        _leave_after_failure(got, interrupt)
        return EXIT_INTERRUPTED
    except AgreedStop as exc:  # a NaN loss, weights that cannot learn (zerogradient.py)
        # Every rank stops at once (they agreed); one sentence, from rank 0.
        if env.rank == 0:
            _say(f"rank {env.rank}: {exc}")
        _leave_after_failure(got, exc)
        return EXIT_FAILED
    except Exception as exc:
        _say_failure(exc, env, got.trainer)
        _leave_after_failure(got, exc)
        return EXIT_FAILED
    finally:
        flag.uninstall()
        sys.stdout.flush()
        sys.stderr.flush()


def _leave_after_failure(got: _Reached, error: BaseException) -> None:
    """Leave the process group after a failure with the model let go first, as a completed
    run does (:func:`_run`; :func:`~orchestrate.train.distributed.leave` says why): the
    trainer, and the frames of the error's traceback that still hold it."""
    got.trainer = None
    traceback.clear_frames(error.__traceback__)  # frames still running are left as they are
    leave(got.cluster, failed=True)


@dataclass
class _Reached:
    """How far this rank got: what its failure handlers must leave."""

    cluster: Cluster | None = None
    trainer: Trainer | None = None


def _run(spec: TrainSpec, env: DistEnv, run_dir: Path, environ: Mapping[str, str],
         flag: StopFlag, got: _Reached) -> int:
    """Join, set up, train and leave (failures after joining are the caller's to handle)."""
    try:
        sidecar.phase("init_process_group")
        got.cluster = cluster = join(env, environ)
    except UserError as err:
        _say(f"rank {env.rank}: {err}")
        return EXIT_USER_ERROR
    except Exception as exc:
        _say(
            f"rank {env.rank}: could not join the process group at "
            f"{env.master_addr}:{env.master_port} ({env.world_size} ranks): {first_line(exc)}"
        )
        leave(None, failed=True)
        return EXIT_FAILED
    sidecar.phase("setup")
    run_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(run_dir, spec, enabled=cluster.rank == 0)
    got.trainer = trainer = _setup(spec, cluster, run_dir, flag, log, environ)
    outcome = trainer.run()
    step = trainer.position.step
    # The model (DDP's reducer holds the process groups), the optimizer and the loaders go
    # now, while Python is whole: left to the interpreter's own teardown, a gloo group died
    # with "terminate called without an active exception" (SIGABRT, after a completed run) in
    # 4 of 30 2-rank runs here, 0 of 30 with them freed first.
    got.trainer = None
    del trainer
    leave(cluster, failed=False)  # which collects what cycles still hold first
    if outcome == "preempted":
        log.say(
            f"stopped by {flag.signal_name or 'a signal'} at step {step}; "
            f"checkpointed, exiting {EXIT_REQUEUE} to be requeued"
        )
        return EXIT_REQUEUE
    return EXIT_OK


def _say_failure(exc: Exception, env: DistEnv, trainer: Trainer | None) -> None:
    """Where training or setup failed, and why (a peer's failure seen here says so)."""
    where = "setup failed"
    if trainer is not None:
        p = trainer.position
        where = f"training failed in epoch {p.epoch + 1} after step {p.step}"
    if _is_peer_failure(exc):
        _say(
            f"rank {env.rank}: {where}: {first_line(exc)} (a collective failed: another "
            "rank probably failed first; look for its message)"
        )
    else:
        _say(traceback.format_exc().rstrip())
        _say(f"rank {env.rank}: {where}: {first_line(exc)}")
