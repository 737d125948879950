"""The ``orchestrate`` command line.

Every user mistake surfaces as :class:`~orchestrate.core.errors.UserError` and leaves through
:func:`main` as ``file: field: problem`` lines with hints and exit status 2, never a traceback.
"""

from __future__ import annotations

import sys

import click

from orchestrate.core.errors import UserError
from orchestrate.version import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="orchestrate")
def cli() -> None:
    """Launch PyTorch DDP training on Slurm, SSH servers or this machine from one job file."""


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (also used by ``python -m orchestrate``)."""
    from orchestrate.cli import (  # noqa: F401  (registers the commands)
        diagnose,
        doctor,
        inspect,
        inventory,
        jobs,
        report,
    )

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
    except (click.Abort, KeyboardInterrupt):
        click.echo("interrupted", err=True)
        return 130
    return result if isinstance(result, int) else 0


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
