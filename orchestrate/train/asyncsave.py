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


def snapshot(value: Any) -> Any:
    """A copy of ``value`` (a state dict: nested dicts, lists and tensors) whose tensors live in
    host memory and share nothing with the live ones, which the next optimizer step changes in
    place."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: snapshot(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(snapshot(item) for item in value)
    return value


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
