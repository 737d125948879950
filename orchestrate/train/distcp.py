"""Sharded checkpoints of ``strategy: fsdp``: every rank writes its shards, nobody gathers.

A sharded checkpoint is a folder in the checkpoint directory, beside (and named like) the DDP
ones::

    step-00000240/
        .metadata          torch.distributed.checkpoint's index of every tensor's pieces
        __0_0.distcp       rank 0's shards of the weights and the optimizer state
        __1_0.distcp       rank 1's
        trainer.pt         the rest, as in a DDP checkpoint: position, schedule, each rank's
                           RNG states, the config (no model, no optimizer)

It is written atomically like a file: every rank writes into ``.step-00000240.tmp-<pid of rank
0>/`` (``torch.distributed.checkpoint.save``, files fsynced; or its ``async_save``, which
copies the shards to host memory and writes them from a thread: ``checkpoint_async``), rank 0
adds ``trainer.pt`` once every rank's shards are written (the save's last step gathers them),
then renames the folder and points ``latest`` at it. A rank killed at any moment leaves the
previous checkpoint and a temporary that the next start deletes.

Loading reshards: the index says where each piece of each tensor is, and every rank reads the
pieces of its own shards, so a checkpoint written on 2 ranks resumes on 3 (checked to 0.0 in
docs/train.md's tests). Reading one in a single process (``orchestrate export``, ``init_from``)
is :func:`orchestrate.train.checkpoint.load`'s, like every other checkpoint file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from orchestrate.train import checkpoint
from orchestrate.train.failure import TrainFailure, first_line

if TYPE_CHECKING:  # imported where used: torch.distributed.checkpoint is slow to import
    from torch.distributed.checkpoint.staging import DefaultStager


def states(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards of the weights and the optimizer state, as DCP reads and writes
    them."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer)}


def save(model: nn.Module, optimizer: torch.optim.Optimizer, side: Mapping[str, Any], *,
         directory: Path, step: int, keep: int, rank: int, tag: int,
         group: dist.ProcessGroup | None) -> Path | None:
    """Write the sharded checkpoint of ``step`` (a collective: every rank calls it with the
    same ``tag``, rank 0's pid); rank 0 returns its path, the others None."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    temporary = temporary_for(directory, step, tag)
    dcp_save(states(model, optimizer), storage_writer=FileSystemWriter(temporary),
             process_group=group)
    return finish(side, directory=directory, step=step, keep=keep, temporary=temporary) \
        if rank == 0 else None


def stager() -> DefaultStager:
    """The stager a rank's background saves share: it keeps the host copy of the shards it
    staged (pinned where there is a GPU) and copies into the same memory at the next save instead
    of allocating 0.5-1 GB each time (docs/performance.md, "Checkpoint stall"). Reusing the copy
    is safe because one save is in flight at a time."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    pinned = torch.cuda.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


def save_async(model: nn.Module, optimizer: torch.optim.Optimizer, *, directory: Path,
               step: int, tag: int, group: dist.ProcessGroup | None,
               staging: DefaultStager) -> Future[Any]:
    """Start the sharded write of ``step`` with ``torch.distributed.checkpoint.async_save``
    (a collective): the shards are copied to host memory (``staging``'s kept copy, from
    :func:`stager`) before it returns, the files are written by its thread. ``group`` must be
    a gloo group of its own: the writing thread's collectives would otherwise interleave with
    the training thread's. Rank 0 calls :func:`finish` once the future is done (every rank's
    shards are then written)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import async_save

    temporary = temporary_for(directory, step, tag)
    started = async_save(states(model, optimizer), storage_writer=FileSystemWriter(temporary),
                         process_group=group, async_stager=staging)
    assert isinstance(started, Future)
    return started


def temporary_for(directory: Path, step: int, tag: int) -> Path:
    """The folder a checkpoint of ``step`` is written into before it is complete."""
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f".{checkpoint.name_for(step, sharded=True)}.tmp-{tag}"


def finish(side: Mapping[str, Any], *, directory: Path, step: int, keep: int,
           temporary: Path) -> Path:
    """Rank 0, once every rank's shards are in ``temporary``: add the trainer's state, rename
    the folder to its final name, point ``latest`` at it, prune."""
    final = directory / checkpoint.name_for(step, sharded=True)
    try:
        checkpoint.write_atomic(temporary / checkpoint.SIDE,
                                lambda h: torch.save(dict(side), h), sync_dir=False)
        if final.exists():  # the same step written before (a rerun of a finished stop)
            checkpoint.remove(final)
        os.replace(temporary, final)
        checkpoint.point_latest(directory, final)
    except OSError as exc:
        checkpoint.remove(temporary)
        raise TrainFailure(f"cannot write checkpoint {final}: {exc.strerror or exc}") from exc
    checkpoint.prune(directory, keep, final)
    return final


def restore(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path,
            group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Load a sharded checkpoint into this rank's shards (any world size); returns the
    trainer's state stored beside them."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    side = checkpoint.sharded_side(path)
    loaded = states(model, optimizer)
    try:
        dcp_load(loaded, checkpoint_id=str(path), process_group=group)
        set_model_state_dict(model, loaded["model"])
        set_optimizer_state_dict(model, optimizer, loaded["optim"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise TrainFailure(
            f"checkpoint {path} does not fit the model or the optimizer "
            f"({first_line(exc)}); was the model changed?") from exc
    return side
