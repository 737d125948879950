"""Checkpoints written in the background: the ranks copy their state to host memory and train on.

A synchronous checkpoint stops every rank for the whole write (torch.save or the sharded write,
then fsync): minutes for a large model. Here the step pays only for the copy (a device-to-host
transfer on GPUs, a memory copy on CPUs) and one :class:`Writer` thread per rank persists the
copy while training goes on. Its rules (docs/train.md, "Checkpoints"):

- one save in flight: the next checkpoint first waits for the write before it (and says so);
- ``latest`` moves only when the write is complete on every rank (the writer renames the
  finished file or folder and points ``latest`` last, as the synchronous path does);
- the stop and end paths wait for the write in flight before their own checkpoint;
- the copy needs host memory: :func:`room_problem` is asked before the first save, and the
  ranks fall back to synchronous saves (saying why) when it would not fit.

A write that fails in the background is raised in the training thread at the next checkpoint
(or at the end), as if the save had failed there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: Host memory the snapshot may take, as a share of what the kernel reports available
#: (MemAvailable): the rest is left to the data loaders, page cache and everyone else.
HOST_SHARE = 0.8
_MEMINFO = "/proc/meminfo"


def snapshot(value: Any, into: Any = None) -> Any:
    """A copy of ``value`` (a state dict: nested dicts, lists and tensors) whose tensors live in
    host memory and share nothing with the live ones, which the next optimizer step changes in
    place.

    ``into`` is an earlier copy whose tensors are reused where shape and dtype still match: the
    copy is then a plain memory copy (or a device-to-host transfer) with no allocation and no
    page faults, the 7x of it on a CPU (docs/performance.md). A device tensor is copied into
    pinned host memory without waiting (``non_blocking``): :meth:`HostCopy.ready` waits.
    """
    if isinstance(value, torch.Tensor):
        source = value.detach()
        if not _fits(into, source):
            into = torch.empty_like(source, device="cpu", pin_memory=source.is_cuda)
        into.copy_(source, non_blocking=source.is_cuda)
        return into
    if isinstance(value, dict):
        kept = into if isinstance(into, dict) else {}
        return {key: snapshot(item, kept.get(key)) for key, item in value.items()}
    if isinstance(value, list | tuple):
        items = list(into) if isinstance(into, list | tuple) and len(into) == len(value) \
            else [None] * len(value)
        return type(value)(snapshot(item, old) for item, old in zip(value, items, strict=True))
    return value


def _device_of(value: Any) -> torch.device | None:
    """The GPU of the first device tensor in ``value`` (None: every tensor is on the host)."""
    if isinstance(value, torch.Tensor):
        return value.device if value.is_cuda else None
    items = value.values() if isinstance(value, dict) \
        else value if isinstance(value, list | tuple) else ()
    for item in items:
        found = _device_of(item)
        if found is not None:
            return found
    return None


def _fits(buffer: Any, source: torch.Tensor) -> bool:
    """Whether ``buffer`` (from an earlier copy) can take ``source`` as it is."""
    return (isinstance(buffer, torch.Tensor) and buffer.shape == source.shape
            and buffer.dtype == source.dtype and buffer.stride() == source.stride()
            and (not source.is_cuda or buffer.is_pinned()))


class HostCopy:
    """A rank's host copy of its state, kept from one background save to the next.

    A background save writes the copy it took; the next save overwrites it in place, which is
    safe because one write is in flight at a time (the next save waits for it first). Device
    tensors are transferred asynchronously: the training thread only queues the transfers, and
    the writer calls :meth:`ready` before it reads the copy.
    """

    def __init__(self) -> None:
        self._copy: Any = None
        self._done: Any = None  # a CUDA event after the queued transfers, or None

    def take(self, value: Any) -> Any:
        """Copy ``value`` into the kept buffers (allocating what does not fit) and return it."""
        self._copy = snapshot(value, self._copy)
        self._done = None
        device = _device_of(value)
        if device is not None:  # after the transfers queued on the training stream
            self._done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._done.record(torch.cuda.current_stream(device))
        return self._copy

    def ready(self) -> None:
        """Wait until the copy is complete in host memory (device transfers finished)."""
        if self._done is not None:
            self._done.synchronize()


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (what :func:`snapshot` copies); a sharded tensor
    counts its local shard."""
    if isinstance(value, torch.Tensor):
        local = getattr(value, "_local_tensor", value)
        return int(local.numel() * local.element_size())
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(item) for item in value)
    return 0


def available_bytes(meminfo: str | None = None) -> int | None:
    """The host's available memory (``MemAvailable`` of /proc/meminfo), None where unknown."""
    if meminfo is None:
        try:
            with open(_MEMINFO, encoding="ascii") as handle:
                meminfo = handle.read()
        except OSError:
            return None
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            fields = rest.split()
            if fields and fields[0].isdigit():
                return int(fields[0]) * 1024
    return None


def room_problem(need: int, local_copies: int, available: int | None) -> str | None:
    """Why a snapshot of ``need`` bytes on each of ``local_copies`` ranks of this host would not
    fit in host memory (None: it fits, or nothing is known to say otherwise)."""
    if available is None or need <= 0:
        return None
    total = need * max(1, local_copies)
    if total <= available * HOST_SHARE:
        return None
    copies = f"{local_copies} ranks x " if local_copies > 1 else ""
    return (f"a host-memory copy needs {copies}{need / 1e9:.2f} GB and this host has "
            f"{available / 1e9:.2f} GB available (at most {HOST_SHARE:.0%} of it is used)")


@dataclass
class _Flight:
    """One write in the background."""

    label: str
    thread: threading.Thread
    error: BaseException | None = None


class Writer:
    """Runs one write at a time in a background thread of this rank."""

    def __init__(self) -> None:
        self._flight: _Flight | None = None

    @property
    def busy(self) -> str | None:
        """The label of the write in flight, if one is still running."""
        flight = self._flight
        return None if flight is None or not flight.thread.is_alive() else flight.label

    def start(self, label: str, write: Callable[[], None]) -> None:
        """Run ``write`` in the background (the write before it must be waited for)."""
        assert self._flight is None, "one write in flight at a time"

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # raised in the training thread by wait()
                flight.error = exc

        # A daemon: a rank that fails leaves its write behind as a temporary (the next start
        # deletes it) rather than hang in a collective on its way out.
        thread = threading.Thread(target=run, name=f"checkpoint-{label}", daemon=True)
        flight = _Flight(label, thread)
        self._flight = flight
        thread.start()

    def wait(self) -> tuple[str, float] | None:
        """Wait for the write in flight; returns its label and the seconds waited (None when
        there was none). Its failure is raised here."""
        flight, self._flight = self._flight, None
        if flight is None:
            return None
        began = time.perf_counter()
        flight.thread.join()
        if flight.error is not None:
            raise flight.error
        return flight.label, time.perf_counter() - began

