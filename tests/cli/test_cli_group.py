"""The lazily loading command group (orchestrate/cli/group.py): its table names every command
where it lives with its own help, the help it prints is click's, and ``--help`` or a command
imports no other command's module."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest

from orchestrate.cli.group import COMMANDS, LazyGroup
from tests.support.corecli import REPO, cli

pytestmark = pytest.mark.unit


def test_every_table_entry_is_that_command_with_its_own_help() -> None:
    for name, lazy in COMMANDS.items():
        command = lazy.load()
        assert command.name == name, (name, command.name)
        first = command.get_short_help_str(limit=10**6)
        assert lazy.help == first, f"{name}: the table says {lazy.help!r}, the command {first!r}"
        for width in (30, 45, 60, 80):
            stand_in = click.Command(name, help=lazy.help)
            assert stand_in.get_short_help_str(width) == command.get_short_help_str(width)


def _commands_section(command: click.Group) -> str:
    with click.Context(command, info_name="orchestrate") as ctx:
        formatter = ctx.make_formatter()
        command.format_commands(ctx, formatter)
        return formatter.getvalue()


def test_the_help_lists_every_command_as_click_lists_loaded_ones() -> None:
    nothing_loaded = LazyGroup("orchestrate", lazy=COMMANDS)
    plain = click.Group("orchestrate")
    for name, lazy in COMMANDS.items():
        plain.add_command(lazy.load(), name)
    section = _commands_section(nothing_loaded)
    assert section == _commands_section(plain)
    assert nothing_loaded.commands == {}, "listing the commands loaded one"
    assert [line.split()[0] for line in section.splitlines()[1:]] == sorted(COMMANDS)
    whole = cli("--help")
    assert whole.code == 0 and section in whole.out, whole.out + whole.err


def test_an_unknown_command_is_refused_by_name() -> None:
    result = cli("sumbit", "job.yaml")
    assert result.code == 2 and "No such command 'sumbit'" in result.err


def test_a_group_without_a_table_is_a_plain_group() -> None:
    @click.group(cls=LazyGroup, lazy={})
    def empty() -> None:
        """Nothing."""

    with click.Context(empty, info_name="empty") as ctx:
        assert empty.list_commands(ctx) == [] and "Commands" not in empty.get_help(ctx)


IMPORTED = """
import json, sys
from orchestrate.cli import main
code = main(sys.argv[1:])
print(json.dumps([code, sorted(m for m in sys.modules if m.startswith("orchestrate.cli."))]))
"""


@pytest.mark.process
@pytest.mark.parametrize(("args", "modules"), [
    (["--help"], ["orchestrate.cli.group"]),
    (["--version"], ["orchestrate.cli.group"]),
    (["schema", "--help"], ["orchestrate.cli.group", "orchestrate.cli.inspect",
                            "orchestrate.cli.tables"]),
    (["list", "--help"], ["orchestrate.cli.completion", "orchestrate.cli.group",
                          "orchestrate.cli.jobs", "orchestrate.cli.tables"]),
])
def test_only_the_command_that_runs_is_imported(args: list[str], modules: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-c", IMPORTED, *args], capture_output=True,
                          text=True, cwd=REPO, timeout=60, check=False)
    last = proc.stdout.strip().splitlines()[-1]
    assert json.loads(last) == [0, modules], proc.stdout + proc.stderr
