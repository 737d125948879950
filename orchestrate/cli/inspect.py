"""Commands that read and explain, and launch nothing: validate, plan, render, schema.

(``inventory show``, ``probe`` and ``check`` live in :mod:`orchestrate.cli.inventory`.)"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from orchestrate.cli.tables import console, decision_line, plan_tables
from orchestrate.core.errors import Problem, UserError
from orchestrate.core.spec.inventory import InventorySpec, load_inventory
from orchestrate.core.spec.job import JobSpec
from orchestrate.core.spec.loader import read_yaml
from orchestrate.run.prepare import prepare

SET_HELP = "override a job field, e.g. --set resources.nodes=2 (repeatable)"
JOB_ID_HELP = "job id to plan for (default: NAME-dryrun; submit makes a fresh one)"


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
def validate(files: tuple[Path, ...]) -> None:
    """Check inventory and job files; prints every problem found."""
    problems: list[Problem] = []
    for path in files:
        kind, data = "job", None
        try:
            data, _ = read_yaml(path)
            kind = file_kind(data)
            if kind == "inventory":
                load_inventory(path)
            else:
                prepare(path)
            click.echo(f"{path}: ok ({kind})")
        except UserError as exc:
            problems.extend(_name_stray_keys(exc.problems, kind, data))
    if problems:
        raise UserError(problems)


#: What makes a file a job: a job has ``train`` or ``command``, and its ``resources``; an
#: inventory has none of them. (``env``, ``backend``... are only job keys too, but one of them
#: in an inventory is a stray key of that inventory, not a sign that it is a job.)
JOB_SHAPE = ("command", "resources", "train")


def file_kind(data: object) -> str:
    """``inventory`` or ``job``, by the file's shape: ``nodes:`` and none of :data:`JOB_SHAPE`
    is an inventory; anything else is checked as a job."""
    if isinstance(data, dict) and "nodes" in data and not set(JOB_SHAPE) & set(data):
        return "inventory"
    return "job"


def _name_stray_keys(problems: tuple[Problem, ...], kind: str, data: object) -> list[Problem]:
    """An unknown top-level key that the other kind of file has: say so, and why the file was
    read as this kind, so that the one stray key is the whole story."""
    other = JobSpec if kind == "inventory" else InventorySpec
    other_keys = {f.alias or name for name, f in other.model_fields.items()}
    if kind == "inventory":
        why = ("read as an inventory: it has 'nodes' and none of "
               + ", ".join(f"'{k}'" for k in JOB_SHAPE))
    else:
        shape = [k for k in JOB_SHAPE if isinstance(data, dict) and k in data]
        why = "read as a job" + (f": it has '{shape[0]}'" if shape else "")
    whose = "a job file's" if kind == "inventory" else "an inventory file's"
    named = []
    for p in problems:
        stray = p.message == "unknown key" and "." not in p.field and p.field in other_keys
        if stray and not p.hint.startswith("did you mean"):  # resources.nodes says it all
            p = replace(p, hint=f"'{p.field}' is {whose} key; this file is {why}. {p.hint}")
        named.append(p)
    return named


_COMPACT = json.JSONEncoder(separators=(", ", ": ")).encode


def readable_json(value: Any, level: int = 0, depth: int = 2) -> str:
    """JSON indented ``depth`` levels deep, deeper values on one line: one node or one rank per
    line, like the tables. (Also 4x faster than ``indent=2``, which bypasses json's C encoder:
    a 4,096-node plan has 32,768 ranks.)"""
    if level >= depth or not isinstance(value, dict | list) or not value:
        return _COMPACT(value)
    pad = "  " * (level + 1)
    if isinstance(value, dict):
        items = [
            f"{pad}{_COMPACT(k)}: {readable_json(v, level + 1, depth)}" for k, v in value.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + "  " * level + "}"
    items = [pad + readable_json(v, level + 1, depth) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + "  " * level + "]"


@click.command()
@click.argument("job", type=click.Path(path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE", help=SET_HELP)
@click.option("--job-id", default=None, help=JOB_ID_HELP)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def plan(job: Path, overrides: tuple[str, ...], job_id: str | None, as_json: bool) -> None:
    """Show where every rank runs and with what environment; launches nothing."""
    from orchestrate.cli.progress import progress

    with progress("planning", enabled=not as_json):  # a memory trace takes up to a minute
        prepared = prepare(job, overrides, job_id=job_id)
    if as_json:
        click.echo(readable_json(prepared.plan.to_json()))
        return
    out = console()
    for table in plan_tables(prepared.plan):
        out.print(table)
    decided = decision_line(prepared.plan)
    if decided:
        out.print(decided, highlight=False)
    for warning in prepared.plan.warnings:
        out.print(f"[yellow]warning:[/] {warning}", highlight=False)
    memory = prepared.plan.memory
    for note in (*prepared.plan.notes, *(memory.notes if memory is not None else ())):
        out.print(f"note: {note}", highlight=False)
    out.print(prepared.plan.restart.describe(), highlight=False)


@click.command()
@click.argument("job", type=click.Path(path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE", help=SET_HELP)
@click.option("--job-id", default=None, help=JOB_ID_HELP)
@click.option(
    "-o", "--output", type=click.Path(path_type=Path), default=None,
    help="write the files into this folder instead of printing them",
)
def render(job: Path, overrides: tuple[str, ...], job_id: str | None, output: Path | None) -> None:
    """Print (or write) exactly the scripts a backend would submit."""
    from orchestrate.backends import rendered
    from orchestrate.core.render.render import merged

    files = rendered(prepare(job, overrides, job_id=job_id))
    if output is None:
        click.echo(merged(files), nl=False)
        return
    if output.exists() and not output.is_dir():
        raise UserError.single("exists and is not a folder", field="-o/--output",
                               got=str(output), hint="-o names a folder for the scripts")
    try:
        output.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            target = output / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
            if name.endswith((".sh", ".sbatch")):
                target.chmod(0o755)
            click.echo(str(target))
    except OSError as exc:
        raise UserError.single(f"cannot write: {exc.strerror}", field="-o/--output",
                               got=str(exc.filename or output)) from None


@click.command()
@click.argument("kind", type=click.Choice(["inventory", "job"]))
def schema(kind: str) -> None:
    """Print the JSON Schema of inventory or job files (for editors)."""
    model = InventorySpec if kind == "inventory" else JobSpec
    click.echo(json.dumps(model.model_json_schema(), indent=2))
