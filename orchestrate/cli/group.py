"""The ``orchestrate`` command group, which imports a command's module only when it is needed.

Why lazily: every command pays for the CLI's start. Importing every command module up front
(the planner and pydantic's spec models, the doctor, the inventory prober, the backends) made
``orchestrate --help`` 3.35x a bare ``import click, pydantic, yaml`` and ``status`` wait for
modules it never uses. Here a command's module is imported when that command runs or its own
help is shown; the group's help lists every command from :data:`COMMANDS` without importing one.

The command modules define plain click commands (``@click.command()``) and never import this
group, so no module imports the package that imports it back. A command is added by writing it
in its module and naming it in :data:`COMMANDS` with its one-line help;
tests/cli/test_cli_group.py checks that the table and the commands agree.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

import click

from orchestrate.version import __version__


class Lazy:
    """Where a command lives (``module``, ``attribute``) and the first sentence of its help,
    for the group's help (a longer help is shortened there, as click shortens any)."""

    __slots__ = ("attribute", "help", "module")

    def __init__(self, module: str, attribute: str, help: str) -> None:
        self.module = module
        self.attribute = attribute
        self.help = help

    def load(self) -> click.Command:
        command = getattr(importlib.import_module(self.module), self.attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{self.module}.{self.attribute} is not a click command")
        return command


#: Every command (the help lists them sorted, as click does): name -> where it lives.
COMMANDS: Mapping[str, Lazy] = {
    "cancel": Lazy("orchestrate.cli.jobs", "cancel",
                   "Stop every process of the job(s), on every host."),
    "diagnose": Lazy("orchestrate.cli.diagnose", "diagnose",
                     "Every rank's phase, step, collectives and frame; who a stalled job waits "
                     "for."),
    "doctor": Lazy("orchestrate.cli.doctor", "doctor",
                   "Check the planned job's nodes before it runs: versions, GPUs, interface, "
                   "shm, memlock and clocks (static); the master port and node-to-node ports "
                   "(connect); every rank joining and a checked all_reduce (smoke); all_reduce "
                   "and node-to-node bandwidth against the inventory (bandwidth)."),
    "export": Lazy("orchestrate.cli.export", "export",
                   "Write a job's trained weights (DDP or FSDP checkpoint) as one plain state "
                   "dict."),
    "gpus": Lazy("orchestrate.cli.gpus", "gpus",
                 "Every GPU of this machine (or of an inventory's SSH nodes) with its model, "
                 "memory used/total, utilization, health (pass, warn or fail) and holders: "
                 "orchestrate jobs (user, job id, since) and processes outside orchestrate "
                 "(pid, user, name, memory)."),
    "inventory": Lazy("orchestrate.cli.inventory", "inventory",
                      "Inspect inventory files, write them from the machines, check them for "
                      "drift."),
    "list": Lazy("orchestrate.cli.jobs", "list_jobs", "Recent jobs, newest first."),
    "logs": Lazy("orchestrate.cli.jobs", "logs",
                 "A job's merged output with [node:rank] prefixes, or one rank's."),
    "plan": Lazy("orchestrate.cli.inspect", "plan",
                 "Show where every rank runs and with what environment; launches nothing."),
    "queue": Lazy("orchestrate.cli.queue", "queue",
                  "This machine's queue: running jobs, waiting jobs in the order they will "
                  "start (each with its place and what it waits for), each user's decayed use "
                  "and share, and the policy in force."),
    "render": Lazy("orchestrate.cli.inspect", "render",
                   "Print (or write) exactly the scripts a backend would submit."),
    "report": Lazy("orchestrate.cli.report", "report",
                   "Write a job's self-contained HTML report: plan, loss, per-rank time split "
                   "with the straggler, phase timeline, doctor bandwidth."),
    "resume": Lazy("orchestrate.cli.jobs", "resume",
                   "Run an ended job again as its next attempt: same id and run directory, so "
                   "the built-in trainer resumes from its last checkpoint; planned again from "
                   "the job as it was submitted."),
    "schema": Lazy("orchestrate.cli.inspect", "schema",
                   "Print the JSON Schema of inventory or job files (for editors)."),
    "status": Lazy("orchestrate.cli.jobs", "status",
                   "A job's state, per-rank exit status, the first failure and the straggler "
                   "(default: the latest job)."),
    "submit": Lazy("orchestrate.cli.jobs", "submit",
                   "Launch a job; exits 0 when a followed job completes, 1 when it fails (or, "
                   "with --preflight, when a check failed and nothing was submitted), 75 when it "
                   "could not be placed now (or, waiting, within its bound), 130 when Ctrl-C "
                   "cancelled a followed job."),
    "validate": Lazy("orchestrate.cli.inspect", "validate",
                     "Check inventory and job files; prints every problem found."),
}


class LazyGroup(click.Group):
    """A click group whose commands are imported on first use (see the module docstring)."""

    def __init__(self, *args: object, lazy: Mapping[str, Lazy], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lazy = dict(lazy)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy:
            self.add_command(self.lazy[cmd_name].load(), cmd_name)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's command list; a command not loaded yet is listed through a stand-in made of
        its table entry (click shortens the same text the same way)."""
        shown: list[tuple[str, click.Command]] = []
        for name in self.list_commands(ctx):
            command = self.commands.get(name) or click.Command(name, help=self.lazy[name].help)
            if not command.hidden:
                shown.append((name, command))
        if not shown:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in shown)
        with formatter.section("Commands"):
            formatter.write_dl([(name, command.get_short_help_str(limit))
                                for name, command in shown])


@click.group(cls=LazyGroup, lazy=COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="orchestrate")
def cli() -> None:
    """Launch PyTorch DDP training on Slurm, SSH servers or this machine from one job file."""
