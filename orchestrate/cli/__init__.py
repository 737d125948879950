"""The ``orchestrate`` command line.

Every user mistake surfaces as :class:`~orchestrate.core.errors.UserError` and leaves through
:func:`main` as ``file: field: problem`` lines with hints and exit status 2, never a traceback;
so does an optional extra that is not installed (:mod:`orchestrate.run.extras`).
The commands themselves are imported only when they run (:mod:`orchestrate.cli.group`).
"""

from __future__ import annotations

import sys

import click

from orchestrate.cli.group import cli
from orchestrate.core.errors import UserError

__all__ = ["cli", "entry", "main"]


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (also used by ``python -m orchestrate``)."""
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
    a caller of :func:`main` in its own process starts it after, as before)."""
    from orchestrate.backends import early

    early.ENABLED = True
    sys.exit(main())
