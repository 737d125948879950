"""The live progress line of a long command on a terminal: which phase, on which host.

A command wraps its slow part in :func:`progress`; the code below the CLI reports its phases
through :mod:`orchestrate.run.progress`, which this fills in. On a terminal the line is rich's
status (a spinner and the phase, redrawn in place on standard error, gone when the step ends);
on a pipe, in a file or with ``--json`` nothing extra is written, so scripts read what they
read before.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from orchestrate.cli.terminal import is_terminal
from orchestrate.run.progress import reporting


def phase_text(phase: str, host: str | None = None) -> str:
    """``copying the job's files (gpu01)...``"""
    return f"{phase} ({host})..." if host else f"{phase}..."


@contextlib.contextmanager
def progress(first: str, *, enabled: bool = True) -> Iterator[None]:
    """Show ``first``, then each phase reported, on standard error while the block runs, when
    that is a terminal and ``enabled`` (not ``--json``)."""
    if not enabled or not is_terminal(sys.stderr):
        yield
        return
    from rich.console import Console

    status = Console(file=sys.stderr).status(phase_text(first))

    def update(phase: str, host: str | None = None) -> None:
        # Naming the spinner makes rich redraw now: a text alone waits for the next tick
        # (1/12.5 s), so a phase shorter than that (claiming, on a quiet machine) was never
        # shown, nor the first one when the next came within a tick.
        status.update(phase_text(phase, host), spinner="dots")

    status.start()
    update(first)
    try:
        with reporting(update):
            yield
    finally:
        status.stop()
