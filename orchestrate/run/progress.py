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
from collections.abc import Iterator
from typing import Protocol


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


@contextlib.contextmanager
def reporting(progress: Progress) -> Iterator[None]:
    """Calls to :func:`show` go to ``progress`` within the block."""
    global _current
    previous, _current = _current, progress
    try:
        yield
    finally:
        _current = previous
