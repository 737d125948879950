"""``orchestrate doctor``: check the planned job's nodes through its own backend."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from orchestrate.cli.tables import console
from orchestrate.doctor.checkup.options import TIERS  # light: the CLI's start stays so

if TYPE_CHECKING:
    from rich.table import Table

    from orchestrate.doctor.grading import Check
    from orchestrate.doctor.run import Run

_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red"}


def checks_table(checks: Sequence[Check], title: str) -> Table:
    """A row per check and node(s): status, measured vs expected, and what to do."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in ("tier", "check", "node(s)", "status", "measured", "expected"):
        table.add_column(column, overflow="fold")
    table.add_column("detail / what to do", overflow="fold", ratio=1)
    for c in checks:
        text = escape(c.detail)
        if c.hint:
            text += f"\n[dim]→ {escape(c.hint)}[/]"
        table.add_row(c.tier, escape(c.name), escape(", ".join(c.nodes)),
                      f"[{_STYLE[c.status]}]{c.status}[/]", escape(c.measured or ""),
                      escape(c.expected or ""), text)
    return table


def report(run: Run, stderr: bool = False) -> None:
    """The table, the verdict, the time and the files, for people."""
    out = console(stderr)
    failed = len(run.failed())
    warned = sum(1 for c in run.checks if c.status == "warn")
    out.print(checks_table(run.checks, f"doctor {run.job_id}: {', '.join(run.tiers)} on "
                           f"{len(run.shape.nodes)} node(s) via {run.backend}"))
    out.print(f"verdict: [{_STYLE[run.verdict]}]{run.verdict}[/] ({len(run.checks)} check(s): "
              f"{failed} failed, {warned} warning(s)); took {run.seconds:.1f} s")
    for path in run.files:
        out.print(f"wrote {path}", markup=False)


@click.command()
@click.argument("job_file", type=click.Path(path_type=Path))
@click.option("--tier", default="all", show_default=True,
              type=click.Choice([*TIERS, "all"]),
              help="how far to go: each tier includes the ones before it")
@click.option("--json", "as_json", is_flag=True,
              help="print the document (verdict, checks, bandwidth) instead of the table")
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE",
              help="override a job field (repeatable)")
@click.option("--job-id", default=None, help="plan the job under this id (as `plan` does)")
@click.option("--sizes", default=None, metavar="32K,1M,...",
              help="all_reduce sizes of the bandwidth tier (default: up to 256M on CPUs, 1G "
              "on GPUs)")
@click.option("--pair-size", default=None, metavar="SIZE",
              help="bytes per node-to-node transfer (default 16M on CPUs, 256M on GPUs)")
@click.option("--budget-s", type=float, default=None,
              help="seconds of timed iterations per size (default 2)")
@click.option("--timeout-s", type=float, default=20.0, show_default=True,
              help="bound of each step of the checkup")
@click.option("--connect-window-s", type=float, default=20.0, show_default=True,
              help="how long the roll call on the master port waits for every node")
@click.option("--deadline-s", type=float, default=None,
              help="bound of the whole doctor run, launch included (default: computed)")
def doctor(job_file: Path, tier: str, as_json: bool, overrides: tuple[str, ...],
           job_id: str | None, sizes: str | None, pair_size: str | None,
           budget_s: float | None, timeout_s: float, connect_window_s: float,
           deadline_s: float | None) -> None:
    """Check the planned job's nodes before it runs: versions, GPUs, interface, shm, memlock
    and clocks (static); the master port and node-to-node ports (connect); every rank joining
    and a checked all_reduce (smoke); all_reduce and node-to-node bandwidth against the
    inventory (bandwidth). Exits 0 when nothing failed, 1 when a check failed, 2 for a mistake
    in the job or inventory."""
    from orchestrate.cli.progress import progress
    from orchestrate.doctor import run as doctoring
    from orchestrate.run.prepare import prepare

    settings = doctoring.Settings(tier=tier, sizes=sizes, pair_size=pair_size,
                                  budget_s=budget_s, timeout_s=timeout_s,
                                  window_s=connect_window_s, deadline_s=deadline_s)
    with progress("planning", enabled=not as_json):  # each tier and host as it runs
        prepared = prepare(job_file, overrides, job_id=job_id)
        run = doctoring.run(prepared, settings)
    if as_json:
        click.echo(json.dumps(run.document, indent=2))
        click.echo(f"doctor: {run.verdict} ({len(run.failed())} failed) in {run.seconds:.1f} s",
                   err=True)
        for path in run.files:
            click.echo(f"wrote {path}", err=True)
    else:
        report(run)
    if run.exit_status:
        click.echo(f"failed: {doctoring.names(run.failed())}", err=True)
    raise click.exceptions.Exit(run.exit_status)


__all__ = ["checks_table", "doctor", "report"]
