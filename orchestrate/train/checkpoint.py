"""Checkpoints: written atomically by rank 0, found again after a requeue, loaded leniently.

Layout of a checkpoint directory (``<run_dir>/checkpoints`` unless ``checkpoint_dir`` says)::

    step-00000120.pt   one file per kept checkpoint, named by optimizer step (DDP)
    step-00000240      or one folder per checkpoint: FSDP's shards (orchestrate.train.distcp)
    latest             one line: the name of the newest complete checkpoint

A file is written to a temporary name in the same directory, flushed and fsynced, then renamed
over its final name with ``os.replace``; ``latest`` is replaced the same way after it. A rank killed
at any moment (SIGKILL after the grace period) therefore leaves either the old or the new
checkpoint, never a torn one; stray temporaries are deleted on the next start.

:func:`load` reads either kind in one process (a sharded folder's weights gathered into one
plain state dict: ``orchestrate export``, ``init_from``); writing and restoring the sharded kind,
every rank its own shards, is :mod:`orchestrate.train.distcp`'s, built on this module.

The model is saved as ``model.module.state_dict()``, without DDP's ``module.`` prefix, so the file
loads into a plain model. Loading accepts either form, because other tools save the prefixed one.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import zipfile
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from orchestrate.train.failure import TrainFailure, first_line

#: Version of the checkpoint dictionary's layout (see docs/train.md).
FORMAT = 1
LATEST = "latest"
_NAME = re.compile(r"step-(\d+)(\.pt)?")
#: A sharded checkpoint's folder is complete once torch.distributed.checkpoint wrote this.
SHARDED_METADATA = ".metadata"
#: The trainer's own state inside a sharded checkpoint's folder (orchestrate.train.distcp).
SIDE = "trainer.pt"
_TEMPORARY = re.compile(r"\..+\.tmp-\d+")
_PREFIX = "module."


def name_for(step: int, *, sharded: bool = False) -> str:
    """Name of the checkpoint taken after optimizer step ``step`` (a folder when sharded)."""
    return f"step-{step:08d}" + ("" if sharded else ".pt")


def is_sharded(path: Path) -> bool:
    """Whether ``path`` is a sharded checkpoint (a folder that torch.distributed.checkpoint
    completed)."""
    return path.is_dir() and (path / SHARDED_METADATA).is_file()


def remove(path: Path) -> None:
    """Delete a checkpoint or a temporary, file or folder."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temporary_for(path: Path) -> Path:
    """The temporary ``path`` is written to before it is renamed (deleted on the next start
    when a writer was killed: :func:`clean_temporaries`)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_atomic(path: Path, write: Callable[[IO[bytes]], None], *, sync_dir: bool = True) -> None:
    """Write ``path`` so that readers see the old content or the new, never a part.

    The data is fsynced before the rename; ``sync_dir`` also fsyncs the directory so the rename
    itself survives a power loss.
    """
    temporary = temporary_for(path)
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if sync_dir:
        _fsync_dir(path.parent)


def _write_bytes(handle: IO[bytes], data: bytes) -> None:
    handle.write(data)


def checkpoints_in(directory: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _NAME.fullmatch(entry.name)
        if match and (entry.is_file() if match.group(2) else is_sharded(entry)):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def save(state: Mapping[str, Any], directory: Path, step: int, keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step``, point ``latest`` at it, keep the newest
    ``keep`` checkpoints."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name_for(step)
    try:
        # One directory fsync (after ``latest``) covers both renames: should a crash persist
        # the pointer's rename but not the checkpoint's, find_latest falls back to the newest.
        write_atomic(path, lambda handle: torch.save(dict(state), handle), sync_dir=False)
        point_latest(directory, path)
    except (OSError, RuntimeError) as exc:
        # torch.save reports a full disk from its C++ writer ("inline_container.cc ...
        # unexpected pos"), which names neither the cause nor the place.
        if _disk_full(exc, directory):
            kept = find_latest(directory)
            raise TrainFailure(
                f"no space left on device at {directory}: checkpoint {path.name} was not "
                "written; " + (f"the previous one is kept ({kept.name})" if kept is not None
                               else "no earlier checkpoint exists")
                + " (free space there, or set train.checkpoint_dir / keep_checkpoints)"
            ) from exc
        raise
    prune(directory, keep, path)
    return path


def point_latest(directory: Path, path: Path) -> None:
    """Make ``latest`` name ``path`` (atomically, with the directory fsynced)."""
    pointer = f"{path.name}\n".encode()
    write_atomic(directory / LATEST, lambda handle: _write_bytes(handle, pointer))


def prune(directory: Path, keep: int, newest: Path) -> None:
    """Delete the checkpoints beyond the newest ``keep`` (never ``newest``)."""
    for _, old in checkpoints_in(directory)[:-keep]:
        if old != newest:
            remove(old)


def _disk_full(exc: BaseException, directory: Path) -> bool:
    """Whether a failed write was the file system running out of space."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        free = os.statvfs(directory)
    except OSError:
        return False
    return free.f_bavail * free.f_frsize < 1 << 20


def clean_temporaries(directory: Path) -> list[Path]:
    """Delete temporaries left by a writer that was killed; returns what was deleted."""
    if not directory.is_dir():
        return []
    removed = []
    for entry in directory.iterdir():
        if _TEMPORARY.fullmatch(entry.name):
            remove(entry)
            removed.append(entry)
    return removed


def find_latest(directory: Path, skipped: list[str] | None = None) -> Path | None:
    """The checkpoint to resume from: the one ``latest`` names, else the newest complete one;
    one whose files are not whole (:func:`incomplete`) is passed over for the one before it,
    and why is appended to ``skipped``."""
    candidates = [path for _, path in reversed(checkpoints_in(directory))]
    pointer = directory / LATEST
    if pointer.is_file():
        named = directory / pointer.read_text(encoding="utf-8").strip()
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    for path in candidates:
        why = incomplete(path)
        if why is None:
            return path
        if skipped is not None:
            skipped.append(f"{path.name}: {why}")
    return None


def incomplete(path: Path) -> str | None:
    """Why a checkpoint cannot be read whole (a file cut short: a full disk, a copy stopped
    half-way), or None. Cheap: a file's zip directory, a sharded one's sizes from its index."""
    if not path.is_dir():
        return None if zipfile.is_zipfile(path) else f"{path.name} is truncated or not a checkpoint"
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    if (path / SIDE).exists() and not zipfile.is_zipfile(path / SIDE):
        return f"{SIDE} is truncated"
    try:
        index = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        return f"its index {SHARDED_METADATA} cannot be read ({first_line(exc)})"
    ends: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        try:
            size = (path / name).stat().st_size
        except OSError:
            return f"shard {name} is missing"
        if size < end:
            return f"shard {name} is truncated ({size:,} of {end:,} bytes)"
    return None


def load(path: Path) -> dict[str, Any]:
    """Load a checkpoint or state-dict file onto the CPU, refusing pickled code (a sharded
    checkpoint: its model's weights under ``model``, and the trainer's state)."""
    if path.is_dir():
        return _read_sharded(path)
    return _load_dict(path, f"checkpoint {path} not found (checkpoint_dir and init_from must "
                            "be on a filesystem every node sees)")


def sharded_side(path: Path) -> dict[str, Any]:
    """The trainer's state stored beside a sharded checkpoint's shards (:data:`SIDE`)."""
    return _load_dict(path / SIDE, f"checkpoint {path} has no {SIDE} (checkpoint_dir must be "
                                   "on a filesystem every node sees)")


def _load_dict(path: Path, missing: str) -> dict[str, Any]:
    """A dict saved with torch.save, onto the CPU, refusing pickled code; a missing file is
    ``missing``, any other failure names the file and the first line of why."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise TrainFailure(missing) from None
    except Exception as exc:
        raise TrainFailure(f"cannot load {path}: {first_line(exc)}") from exc
    if not isinstance(loaded, dict):
        raise TrainFailure(f"{path} holds a {type(loaded).__name__}, not a dict")
    return loaded


def _read_sharded(path: Path) -> dict[str, Any]:
    """A sharded checkpoint as one plain dict in this process: the trainer's state, with the
    whole model's weights under ``model`` (the optimizer state is left on disk). Writing and
    restoring one, every rank its shards, is :mod:`orchestrate.train.distcp`'s."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    if not is_sharded(path):
        raise TrainFailure(f"{path} is a folder but not a complete sharded checkpoint (no "
                           f"{SHARDED_METADATA})")
    why = incomplete(path)
    if why is not None:
        raise TrainFailure(f"cannot read checkpoint {path}: {why}")
    loaded: dict[str, Any] = {}
    try:
        _load_state_dict(loaded, storage_reader=FileSystemReader(str(path)),
                         planner=_EmptyStateDictLoadPlanner(keys={"model"}),  # type: ignore[no-untyped-call]
                         no_dist=True)
    except (Exception, CheckpointException) as exc:  # the latter is a BaseException
        raise TrainFailure(f"cannot read checkpoint {path}: {first_line(exc)}") from exc
    side = sharded_side(path) if (path / SIDE).is_file() else {}
    return {**side, "model": dict(loaded.get("model", {}))}


def model_state_of(loaded: Mapping[str, Any]) -> Mapping[str, Any]:
    """The model's state dict inside a loaded file: ours (``model``), common wrappers
    (``state_dict``, ``model_state_dict``), or the file itself when it is a bare state dict."""
    for key in ("model", "state_dict", "model_state_dict"):
        inner = loaded.get(key)
        if isinstance(inner, Mapping) and inner and all(isinstance(k, str) for k in inner):
            return inner
    return loaded


def align_keys(state: Mapping[str, Any], expected: Collection[str]) -> dict[str, Any]:
    """``state`` with DDP's ``module.`` prefix stripped or added, whichever matches ``expected``
    best (a model may itself have a submodule called ``module``)."""
    plain = dict(state)
    stripped = {k.removeprefix(_PREFIX): v for k, v in state.items()}
    prefixed = {_PREFIX + k: v for k, v in stripped.items()}
    wanted = set(expected)
    return max((plain, stripped, prefixed), key=lambda cand: len(wanted & cand.keys()))


def _listing(keys: Collection[str], limit: int = 6) -> str:
    shown = sorted(keys)[:limit]
    more = len(keys) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def load_model_state(
    module: torch.nn.Module, state: Mapping[str, Any], *, strict: bool, source: str
) -> list[str]:
    """Load ``state`` into ``module``; returns notes on keys that did not match.

    With ``strict`` any missing or unexpected key is an error (resuming must restore everything);
    without it they are reported and loading goes on, unless nothing matched at all.
    """
    expected = module.state_dict().keys()
    aligned = align_keys(state, expected)
    missing = sorted(set(expected) - aligned.keys())
    unexpected = sorted(aligned.keys() - set(expected))
    notes = []
    if missing:
        notes.append(f"{len(missing)} missing key(s): {_listing(missing)}")
    if unexpected:
        notes.append(f"{len(unexpected)} unexpected key(s): {_listing(unexpected)}")
    if (strict and notes) or not set(expected) & aligned.keys():
        raise TrainFailure(f"{source} does not fit the model: " + "; ".join(notes))
    try:
        module.load_state_dict(aligned, strict=False)
    except RuntimeError as exc:  # shape mismatches
        detail = " ".join(line.strip() for line in str(exc).splitlines()[1:4])
        raise TrainFailure(f"{source} does not fit the model: {detail}") from exc
    return notes
