"""Progress of a long step: which phase, on which host, for the person who waits.

Some steps take seconds to a minute with nothing to show: the model probe's memory trace
(18-46 s), logging in to and preflighting every SSH host (8-12 s), the doctor's tiers (20-30 s),
``inventory probe`` over many hosts. The command line shows a live line for them on a terminal
(:mod:`orchestrate.cli.progress`), but the code that knows the phase is below it (``run``,
``backends``, ``doctor``), and nothing imports the CLI. So that code calls :func:`show` with a
phase and a host, and the CLI installs what shows it (:func:`reporting`, a :class:`Progress`)
around the command; without one (a pipe, ``--json``, a library caller, a supervisor) a call
costs a function call and shows nothing. Calls may come from any thread (the SSH fan-out).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Progress(Protocol):
    """Shows that ``phase`` runs now (on ``host``, when it is one host's)."""

    def __call__(self, phase: str, host: str | None = None) -> None: ...


def _quiet(phase: str, host: str | None = None) -> None:
    return None


_current: Progress = _quiet


def show(phase: str, host: str | None = None) -> None:
    """Tell whoever shows progress that ``phase`` runs now (on ``host``); nothing without one."""
    _current(phase, host)


def hosts(names: list[str], limit: int = 3) -> str:
    """``a, b, c and 13 more``: a short name for the hosts a phase runs on at once."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


class HostCount:
    """A phase over many hosts at once, counted as each host is done: ``gathering facts 3/16
    hosts (waiting for h4, h7 and 7 more)``. Thread-safe: the SSH fan-out's threads call
    :meth:`done`."""

    def __init__(self, phase: str, names: Iterable[str]) -> None:
        self.phase = phase
        self.waiting = list(names)
        self.total = len(self.waiting)
        self.lock = threading.Lock()
        with self.lock:
            self._show()

    def done(self, name: str) -> None:
        """``name`` is done (whether it succeeded or not)."""
        with self.lock:
            if name in self.waiting:
                self.waiting.remove(name)
            self._show()

    def counted(self, name_of: Callable[[T], str], work: Callable[[T], R]) -> Callable[[T], R]:
        """``work`` that counts its item as done when it returns or raises."""
        def run(item: T) -> R:
            try:
                return work(item)
            finally:
                self.done(name_of(item))
        return run

    def _show(self) -> None:
        waiting = f"waiting for {hosts(self.waiting)}" if self.waiting else None
        show(f"{self.phase} {self.total - len(self.waiting)}/{self.total} hosts", waiting)


@contextlib.contextmanager
def reporting(progress: Progress) -> Iterator[None]:
    """Calls to :func:`show` go to ``progress`` within the block."""
    global _current
    previous, _current = _current, progress
    try:
        yield
    finally:
        _current = previous
