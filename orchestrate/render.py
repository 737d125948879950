"""Plans into scripts, through Jinja templates that hold layout only.

Every value reaches a script through the ``q`` filter (POSIX shell quoting), and ``comment``
keeps a value on its comment line, so nothing in a job or inventory file can inject a command.
``StrictUndefined`` makes a misspelled variable an error instead of an empty string. What
:func:`render` returns is byte for byte what the backends write and run.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2

from orchestrate import __version__
from orchestrate.errors import UserError
from orchestrate.layout import SBATCH_SCRIPT, TRAIN_CONFIG, node_script_name
from orchestrate.plan import Plan
from orchestrate.ports import PORT_BASE, PORT_SPAN


def quote(value: object) -> str:
    """Shell-quote any value (numbers too, so templates never reason about types)."""
    return shlex.quote(str(value))


def comment(value: object) -> str:
    """A value made safe for a ``#`` comment line: no line breaks or control characters."""
    return "".join(ch if ch.isprintable() else "?" for ch in str(value))


def builtin_templates() -> Path:
    """The templates shipped with the package (or the source tree's, in a checkout)."""
    packaged = Path(str(resources.files("orchestrate"))) / "templates"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "templates"


def environment(templates_dir: Path | None = None) -> jinja2.Environment:
    """A Jinja environment: the job's own templates first, then the built-in ones."""
    paths = [str(builtin_templates())]
    if templates_dir is not None:
        paths.insert(0, str(templates_dir))
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(paths),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["q"] = quote
    env.filters["comment"] = comment
    return env


def render(plan: Plan, templates_dir: Path | None = None) -> dict[str, str]:
    """Every file the plan's backend submits, by file name, in a stable order."""
    env = environment(templates_dir)
    files: dict[str, str] = {}
    context: dict[str, Any] = {
        "plan": plan,
        "version": __version__,
        "port_base": PORT_BASE,
        "port_span": PORT_SPAN,
    }
    try:
        if plan.backend == "slurm":
            files[SBATCH_SCRIPT] = env.get_template("sbatch.sh.j2").render(context)
        else:
            template = env.get_template("node.sh.j2")
            for node in plan.nodes:
                name = node_script_name(node.name)
                files[name] = template.render(context, node=node, script_name=name)
    except jinja2.TemplateError as exc:
        raise UserError.single(
            f"template error: {exc}",
            source=str(templates_dir or builtin_templates()),
            hint="check templates_dir: a job's own templates get the same variables",
        ) from None
    if plan.train_config is not None:
        files[TRAIN_CONFIG] = json.dumps(plan.train_config, indent=2, sort_keys=True) + "\n"
    return files


def merged(files: Mapping[str, str]) -> str:
    """All rendered files as one text, each under a ``==> name <==`` header (like ``tail``)."""
    parts = []
    for name, text in files.items():
        parts.append(f"==> {name} <==\n{text}")
    return "\n".join(parts)
