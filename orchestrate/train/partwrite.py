"""A DDP checkpoint written in the background by every rank: each writes a share of the bytes.

Under DDP every rank holds the same weights and optimizer state, so one file can be written by
all of them at once, each rank copying to host memory and writing only its share of the
tensors: on a machine whose cores all train, the background write's CPU time (copying the
bytes into the page cache) then comes out of every rank's core a little instead of rank 0's a
lot (docs/performance.md, "Checkpoint stall ... session 2").

The file is the ordinary ``torch.save`` checkpoint (``step-N.pt``: :func:`torch.load` and every
tool that reads checkpoints read it unchanged), made in two passes:

1. rank 0 writes its frame into the temporary: ``torch.save`` under
   ``torch.serialization.skip_data`` (every record and the zip directory, the tensors' bytes
   left as holes; no CRC32, which could not cover bytes written later and which
   ``torch.load`` does not check), and reads the offset of every tensor's bytes back from it;
2. every rank writes its share of the bytes at those offsets (``os.pwrite``, which leaves the
   GIL to the training thread), and fsyncs. The ranks then agree on the writer group that every
   share is written; only then does rank 0 rename the temporary and point ``latest`` at it.

Which rank writes what (:func:`owners`) is worked out alike on every rank from the tensors'
sizes: the biggest first, each to the rank with the fewest bytes so far. Only the parameters
and the optimizer state are shared out (DDP keeps them equal on every rank); buffers (a batch
norm's running statistics, which DDP broadcasts from rank 0 only at the next forward) and the
rest of the checkpoint are rank 0's, so the file holds exactly what rank 0 alone would write.
"""

from __future__ import annotations

import functools
import io
import os
import stat
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch.utils.serialization import config as serialization

from orchestrate.train import asyncsave, checkpoint
from orchestrate.train.failure import TrainFailure, first_line

#: Where one tensor sits in a checkpoint's nested dicts and lists: its keys and indexes.
Key = tuple[Any, ...]
#: Tensors smaller than this are rank 0's: sharing them saves nothing and costs a write call.
SMALL = 1 << 16
_CHUNK = 1 << 30  # bytes per pwrite call (Linux writes at most ~2 GiB at a time)
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def leaves(value: Any, key: Key = ()) -> Iterator[tuple[Key, torch.Tensor]]:
    """Every tensor in ``value`` (nested dicts, lists and tuples) with its key, in order."""
    if isinstance(value, torch.Tensor):
        yield key, value
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from leaves(item, (*key, name))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from leaves(item, (*key, index))


def rebuild(value: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """``value`` with its tensors replaced, in :func:`leaves` order, by ``tensors``."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    if isinstance(value, dict):
        return {name: rebuild(item, tensors) for name, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(rebuild(item, tensors) for item in value)
    return value


def owners(sizes: list[int], shared: list[bool], ranks: int) -> list[int]:
    """The rank that writes each tensor: rank 0 those not ``shared`` (and the small ones), the
    rest the biggest first, each to the rank with the fewest bytes so far (lowest on a tie)."""
    owner = [0] * len(sizes)
    load = [0] * max(1, ranks)
    for index, size in enumerate(sizes):
        if not shared[index] or size < SMALL:
            load[0] += size
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        if shared[index] and sizes[index] >= SMALL:
            rank = min(range(len(load)), key=lambda r: (load[r], r))
            owner[index] = rank
            load[rank] += sizes[index]
    return owner


def _nbytes(tensor: torch.Tensor) -> int:
    return int(tensor.numel() * tensor.element_size())


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor``'s storage, as ``torch.save`` writes them."""
    flat = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return memoryview(flat.numpy())  # type: ignore[arg-type]


@dataclass(frozen=True)
class Share:
    """This rank's share of one checkpoint: its host copies, by key, and every tensor's place
    in the file (rank 0 fills that in when it writes the frame)."""

    mine: dict[Key, torch.Tensor]
    whole: dict[str, Any] | None = None  # rank 0: the checkpoint whose frame it writes


class PartCopy:
    """A rank's host copy of its share of the model's and optimizer's state, kept from one
    background save to the next like :class:`~orchestrate.train.asyncsave.HostCopy` (the next
    save overwrites it in place: one write is in flight at a time). Rank 0 also keeps an
    unfilled buffer for every tensor it does not write: the frame needs the tensors' shapes,
    and untouched memory is never made resident."""

    def __init__(self) -> None:
        self._buffers: dict[Key, torch.Tensor] = {}
        self._host = asyncsave.HostCopy()

    @staticmethod
    def plan(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
             ranks: int) -> tuple[dict[str, Any], list[tuple[Key, torch.Tensor]], list[int]]:
        """The state to save, its tensors with their keys, and each tensor's writer."""
        state = {"model": module.state_dict(), "optimizer": optimizer.state_dict()}
        found = list(leaves(state))
        params = {p.data_ptr() for p in module.parameters()}
        shared = [key[0] == "optimizer" or tensor.data_ptr() in params for key, tensor in found]
        return state, found, owners([_nbytes(t) for _, t in found], shared, ranks)

    def take(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, side: Any, *,
             rank: int, ranks: int) -> Share:
        """Copy this rank's share now (device tensors: queued); rank 0 gets the whole
        checkpoint (``side`` with the model and the optimizer) to write the frame of."""
        state, found, owner = self.plan(module, optimizer, ranks)
        mine = {key: tensor for (key, tensor), who in zip(found, owner, strict=True)
                if who == rank}
        copied = self._host.take(mine)
        if rank != 0:
            return Share(copied)
        buffers: list[torch.Tensor] = []
        for key, tensor in found:
            if key in copied:
                buffers.append(copied[key])
                continue
            kept = self._buffers.get(key)
            if not (kept is not None and kept.shape == tensor.shape
                    and kept.dtype == tensor.dtype and kept.stride() == tensor.stride()):
                # Laid out as a host copy of it is (rank N's), never filled here.
                kept = self._buffers[key] = torch.empty_like(tensor, device="cpu")
            buffers.append(kept)
        whole = {**side, **rebuild(state, iter(buffers))}
        return Share({**dict(leaves(side)), **copied}, whole)

    def ready(self) -> None:
        """Wait until the copy is in host memory (device transfers finished)."""
        self._host.ready()

    @classmethod
    def needs(cls, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, rank: int,
              ranks: int) -> int:
        """Bytes of host memory this rank's share takes."""
        _, found, owner = cls.plan(module, optimizer, ranks)
        return sum(_nbytes(t) for (_, t), who in zip(found, owner, strict=True) if who == rank)


def write_frame(whole: dict[str, Any],
                temporary: Path) -> tuple[dict[Key, tuple[int, int]], tuple[int, int]]:
    """Rank 0: write the checkpoint's frame into ``temporary`` (no tensor bytes, no CRC32) and
    return where each tensor's bytes go, ``{key: (offset, bytes)}``, and the device and inode
    of the file written (every share checks it opened that very file: a name in the folder
    may have been replaced since).

    Run it in the training thread: the CRC32 setting is the process's, and only there does no
    other ``torch.save`` run meanwhile (the next checkpoint waits for this one's writer)."""
    with os.fdopen(_open_for_frame(temporary), "r+b") as handle:
        _frame(whole, handle)
        handle.truncate(handle.tell())
        handle.flush()
        made = os.fstat(handle.fileno())
        handle.seek(0)
        return _places(whole, handle, temporary.name), (made.st_dev, made.st_ino)


def _open_for_frame(temporary: Path) -> int:
    """A descriptor to write the frame into: the spare, renamed to ``temporary``, when it is a
    plain file of this user with no other name; else a new file.

    A recycled file is overwritten in place: pages it already has are reused, never freed and
    allocated again (docs/train.md); what is beyond the new frame is cut off. What is checked is
    the file opened (``fstat`` of the descriptor), then that the renamed name is still that
    file: a labmate who can write the checkpoint folder and puts their file, a link, or a second
    name of one of ours there gets a new file written, never theirs or ours written through."""
    spare = spare_in(temporary.parent)
    try:
        descriptor = os.open(spare, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        descriptor = -1
    if descriptor >= 0:
        try:
            found = os.fstat(descriptor)
            if _ours(found):
                os.replace(spare, temporary)
                if os.path.samestat(os.lstat(temporary), found):
                    return descriptor
        except OSError:
            pass
        os.close(descriptor)
    temporary.unlink(missing_ok=True)
    return os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)


def _ours(found: os.stat_result) -> bool:
    """Whether an opened spare is a plain file of this user with this one name: only such a
    file is written into."""
    return (stat.S_ISREG(found.st_mode) and found.st_uid == os.geteuid()
            and found.st_nlink == 1)


def _frame(whole: dict[str, Any], handle: IO[bytes]) -> None:
    was = serialization.save.compute_crc32
    serialization.save.compute_crc32 = False
    try:
        with torch.serialization.skip_data():
            torch.save(whole, handle)
    finally:
        serialization.save.compute_crc32 = was


def _places(whole: dict[str, Any], handle: IO[bytes], name: str) -> dict[Key, tuple[int, int]]:
    """Each tensor's place in a frame: the offset torch.load gives its storage (loading on the
    meta device), checked against the zip records' own places (the stdlib's reading of the
    archive): a place that is not exactly one record's bytes is refused, never written to."""
    records = _records(handle)
    handle.seek(0)
    placed = torch.load(handle, map_location="meta", weights_only=True)
    table = {}
    for (key, tensor), (_, written) in zip(leaves(placed), leaves(whole), strict=True):
        offset = getattr(tensor.untyped_storage(), "_checkpoint_offset", None)
        size = written.untyped_storage().nbytes()
        if (not isinstance(offset, int) or size != tensor.untyped_storage().nbytes()
                or (offset, size) not in records):
            raise TrainFailure(f"cannot place {key} in the frame of {name}: this torch "
                               f"({torch.__version__}) gives no storage offset that matches the "
                               "archive's records")
        table[key] = (offset, size)
    return table


def _records(handle: IO[bytes]) -> set[tuple[int, int]]:
    """Where each record's bytes start in a zip archive, and how many there are: a local
    header is 30 bytes, then the record's name and its extra field (torch pads with it)."""
    found = set()
    with zipfile.ZipFile(handle) as archive:
        for info in archive.infolist():
            handle.seek(info.header_offset)
            header = handle.read(30)
            if header[:4] != b"PK\x03\x04":
                continue
            named, extra = struct.unpack("<HH", header[26:30])
            found.add((info.header_offset + 30 + named + extra, info.file_size))
    return found


@functools.cache
def offsets_supported() -> bool:
    """Whether this torch places a frame's tensors where the archive says (a small frame in
    memory): where not, a DDP checkpoint is written by rank 0 alone, as torch.save does."""
    whole = {"a": torch.arange(3.0), "b": [torch.zeros(70, dtype=torch.float64)], "c": 1}
    buffer = io.BytesIO()
    try:
        _frame(whole, buffer)
        buffer.seek(0)
        _places(whole, buffer, "a probe")
    except (TrainFailure, RuntimeError, ValueError, OSError, zipfile.BadZipFile):
        return False
    return True


#: Where a checkpoint directory is, as a rank sees it: the host's boot id (one per running
#: kernel: containers on one host share it), the file system's device and the inode.
Place = tuple[str, int, int]


def place_of(directory: Path) -> Place | None:
    """``directory`` as this rank sees it (None: it cannot be seen, or the host is unknown)."""
    try:
        boot = Path(BOOT_ID).read_text(encoding="ascii").strip()
        found = os.stat(directory)
    except OSError:
        return None
    return boot, found.st_dev, found.st_ino


def choose(places: list[Place | None], supported: list[bool]) -> tuple[int, ...]:
    """The ranks that write a DDP checkpoint's shares: rank 0 and every rank that sees rank 0's
    checkpoint directory itself (on rank 0's host) with a torch that places frames; a rank on
    another host writes nothing (its copy of the path may be another folder)."""
    if places and places[0] is not None and supported and supported[0]:
        return tuple(rank for rank, place in enumerate(places)
                     if rank == 0 or (place == places[0] and supported[rank]))
    return (0,)


def sharers(control: dist.ProcessGroup, rank: int, world: int,
            directory: Path) -> tuple[int, ...]:
    """:func:`choose` on every rank (a collective on ``control``): rank 0 makes the directory
    and tells where it is, then every rank says whether it sees the same one."""
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    ours: list[Any] = [place_of(directory) if rank == 0 else None]
    dist.broadcast_object_list(ours, src=0, group=control)
    mine = place_of(directory)
    answers: list[Any] = [None] * world
    dist.all_gather_object(answers, (mine if mine == ours[0] else None, offsets_supported()),
                           group=control)
    return choose([a[0] for a in answers], [a[1] for a in answers])


def write_share(temporary: Path, table: dict[Key, tuple[int, int]],
                mine: dict[Key, torch.Tensor], file: tuple[int, int] | None = None) -> None:
    """Write this rank's tensors' bytes at their places in ``temporary`` and fsync them;
    ``file`` is rank 0's ``(device, inode)`` of it: a rank that opened another file (a
    folder mounted differently) writes nothing and says so."""
    fd = os.open(temporary, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        seen = os.fstat(fd)
        if file is not None and (seen.st_dev, seen.st_ino) != tuple(file):
            raise TrainFailure(f"checkpoint {temporary.name} is another file for this rank than "
                               "for rank 0 (its checkpoint_dir is another folder here, or the "
                               "file was replaced meanwhile)")
        for key, tensor in mine.items():
            place = table.get(key)
            data = _bytes_of(tensor)
            if place is None or place[1] != len(data):
                raise TrainFailure(f"checkpoint {temporary.name}: {key} is not in rank 0's frame "
                                   f"as this rank has it ({place} against {len(data)} bytes): "
                                   "the ranks' states differ")
            offset, done = place[0], 0
            while done < len(data):
                done += os.pwrite(fd, data[done:done + _CHUNK], offset + done)
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Job:
    """One checkpoint's background write on one rank."""

    directory: Path
    step: int
    keep: int
    rank: int
    group: dist.ProcessGroup | None  # the writers' own group (None: a single rank)
    share: Share
    temporary: Path | None = None  # rank 0: the frame's file
    table: dict[Key, tuple[int, int]] | None = None  # rank 0: from write_frame
    problem: str | None = None  # rank 0: why the frame was not written
    file: tuple[int, int] | None = None  # rank 0: the frame's (device, inode)

    def run(self, ready: Any) -> Path | None:
        """Write this rank's share once rank 0's frame is there, agree that every rank wrote
        its share, and (rank 0) make the checkpoint ``latest``; rank 0 gets its path."""
        sent = [(str(self.temporary), self.table, self.problem, self.file)]
        if self.group is not None:
            dist.broadcast_object_list(sent, src=dist.get_global_rank(self.group, 0),
                                       group=self.group)
        temporary, table, problem, file = sent[0]
        why = f"rank 0 wrote no frame ({problem})" if problem or table is None else None
        if why is None and table is not None:
            try:
                ready()
                write_share(Path(temporary), table, self.share.mine, file)
            except (OSError, TrainFailure) as exc:
                why = first_line(exc)
        whys: list[Any] = [why]
        if self.group is not None:
            whys = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(whys, why, group=self.group)
        if self.rank != 0:
            if why is not None:
                raise TrainFailure(f"checkpoint of step {self.step}: {why}")
            return None
        return self._finish(Path(temporary), whys)

    def _finish(self, temporary: Path, whys: list[str | None]) -> Path:
        final = self.directory / checkpoint.name_for(self.step)
        failed = [(rank, why) for rank, why in enumerate(whys) if why is not None]
        if failed:
            temporary.unlink(missing_ok=True)
            rank, why = failed[0]
            raise TrainFailure(f"checkpoint {final.name} was not written: rank {rank}: {why}")
        os.replace(temporary, final)
        checkpoint.point_latest(self.directory, final)
        prune(self.directory, self.keep, final)
        return final


def spare_in(directory: Path) -> Path:
    """Where rank 0 keeps the last checkpoint it pruned, to write the next one into (a
    temporary's name: a later start deletes it, :func:`checkpoint.clean_temporaries`)."""
    return checkpoint.temporary_for(directory / "spare.pt")


def prune(directory: Path, keep: int, newest: Path) -> None:
    """:func:`checkpoint.prune`, but the newest checkpoint pruned becomes the spare the next
    frame is written into: its pages (page cache, tmpfs, blocks) are reused, not freed and
    allocated again by the next write. Between two saves the directory so holds one checkpoint
    more than ``keep``, hidden, as much as it held during every write."""
    pruned = [path for _, path in checkpoint.checkpoints_in(directory)[:-keep] if path != newest]
    spare = spare_in(directory)
    if pruned and pruned[-1].is_file() and not pruned[-1].is_symlink() and not spare.exists():
        os.replace(pruned.pop(), spare)
    for path in pruned:
        checkpoint.remove(path)


def start(share: Share, *, directory: Path, step: int, keep: int, rank: int,
          group: dist.ProcessGroup | None) -> Job:
    """In the training thread: rank 0 writes the frame (a failure is carried to every rank's
    writer, which says it); the others only describe their share."""
    if rank != 0 or share.whole is None:
        return Job(directory, step, keep, rank, group, share)
    directory.mkdir(parents=True, exist_ok=True)
    temporary = checkpoint.temporary_for(directory / checkpoint.name_for(step))
    try:
        table, made = write_frame(share.whole, temporary)
    except (OSError, RuntimeError, TrainFailure) as exc:
        temporary.unlink(missing_ok=True)
        return Job(directory, step, keep, rank, group, share, temporary,
                   problem=first_line(exc))
    return Job(directory, step, keep, rank, group, share, temporary, table,
               file=made)
