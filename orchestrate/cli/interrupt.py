"""Ctrl-C in a view of a job: noted at once, acted on between two steps of the view.

A view (``logs JOB -f``, ``status --watch``) is a reader, like ``tail -f`` and ``watch``: Ctrl-C
leaves it and never touches the job. Python raises :class:`KeyboardInterrupt` wherever the main
thread happens to be, which may be in the middle of asking the backend for the job's state and
writing what it said to the job store. So while a view runs, the first Ctrl-C only sets a flag,
and the view's loop calls :meth:`Interrupts.check` between steps, where nothing is half-done;
a second Ctrl-C (a backend that does not answer) interrupts at once, as Python does. Only
``submit --follow`` (and ``resume --follow``) cancel the job on Ctrl-C; they say so when they
start. Either way the command exits 130 (:data:`EXIT_INTERRUPTED`).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

import click

#: The exit status after Ctrl-C (128 + SIGINT, as a shell reports it).
EXIT_INTERRUPTED = 130


class Interrupts:
    """A context in which Ctrl-C is noted (:attr:`seen`) and raised by :meth:`check`."""

    def __init__(self) -> None:
        self.seen = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> Interrupts:
        # Signal handlers can be set only in the main thread; elsewhere Python's default holds.
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._note)
            self._installed = True
        return self

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.seen = True
        signal.signal(signal.SIGINT, self._previous)  # a second Ctrl-C interrupts at once

    def check(self) -> None:
        """Raise :class:`KeyboardInterrupt` if Ctrl-C was pressed since the context began."""
        if self.seen:
            raise KeyboardInterrupt

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)


def leave_view(job_id: str, doing: str = "following") -> click.exceptions.Exit:
    """Say that the view was left and the job goes on; the exit (130) for the caller to raise."""
    click.echo(f"\nstopped {doing}; job {job_id} keeps running "
               f"(stop it with: orchestrate cancel {job_id})", err=True)
    return click.exceptions.Exit(EXIT_INTERRUPTED)


def ignoring_interrupts() -> Any:
    """Ctrl-C ignored until restored (``signal.signal(signal.SIGINT, returned)``): a cancel once
    begun is finished, so that no rank is left behind half-stopped."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, signal.SIG_IGN)
