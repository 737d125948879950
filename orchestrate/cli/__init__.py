"""The ``orchestrate`` command line.

Every user mistake surfaces as :class:`~orchestrate.core.errors.UserError` and leaves through
:func:`main` as ``file: field: problem`` lines with hints and exit status 2, never a traceback;
so does an optional extra that is not installed (:mod:`orchestrate.run.extras`).
The commands themselves are imported only when they run (:mod:`orchestrate.cli.group`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import TYPE_CHECKING, NoReturn

from orchestrate.core.errors import UserError

if TYPE_CHECKING:
    import click

__all__ = ["cli", "entry", "main"]


def __getattr__(name: str) -> click.Group:
    """``cli``, the command group, imported on first use: :func:`entry` starts a submit's
    supervisor before click and the commands are imported (:mod:`orchestrate.backends.early`)."""
    if name == "cli":
        from orchestrate.cli.group import cli

        return cli
    raise AttributeError(name)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (also used by ``python -m orchestrate``)."""
    import click

    from orchestrate.cli.group import cli

    try:
        # Without standalone mode click returns a command's exit status instead of exiting.
        result = cli.main(args=argv, prog_name="orchestrate", standalone_mode=False)
    except UserError as exc:
        for problem in exc.problems:
            click.echo(f"error: {problem.render()}", err=True)
        return exc.exit_status  # 2, or 75 when other jobs hold what it needs: try again later
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except ImportError as exc:  # an optional extra not installed: say which, no traceback
        from orchestrate.run.extras import missing

        error = missing(exc)
        if error is None:
            raise
        for problem in error.problems:
            click.echo(f"error: {problem.render()}", err=True)
        return error.exit_status
    except (click.Abort, KeyboardInterrupt):
        click.echo("interrupted", err=True)
        return 130
    return result if isinstance(result, int) else 0


def entry() -> None:
    """Console-script entry point (and ``python -m orchestrate``): this process is the CLI's
    own, so ``submit`` starts its supervisor before it plans (:mod:`orchestrate.backends.early`;
    a caller of :func:`main` in its own process starts it after, as before): before click and
    the commands are even imported, when the command line reads ``submit ...``."""
    from orchestrate.backends import early

    early.ENABLED = True
    early.prestart(sys.argv[1:])
    leave(main())


def leave(status: int) -> NoReturn:
    """End the CLI's process with ``status`` without tearing the interpreter down.

    Why: freeing every module and object at exit took 60-100 ms of a local ``submit --follow``
    (pydantic's models, the plan), after the job had ended and everything was said. What an
    exit must still do is done first: the ``atexit`` handlers (temporary files, logging) and
    the flush of standard output and error. A thread that is not a daemon is waited for, as at
    a normal exit; a stream that cannot be flushed (a closed pipe) gets the normal exit too."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()
           if t is not threading.main_thread()):
        sys.exit(status)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        sys.exit(status)  # the atexit handlers still to run, once, by the normal exit
    atexit._run_exitfuncs()
    with contextlib.suppress(OSError, ValueError):  # what the handlers printed
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)
