"""Plans into scripts, through Jinja templates that hold layout only.

Every value reaches a script through the ``q`` filter (POSIX shell quoting), and ``comment``
keeps a value on its comment line, so nothing in a job or inventory file can inject a command.
``StrictUndefined`` makes a misspelled variable an error instead of an empty string. Each
backend names the files it submits (``Backend.files``) from these pieces; what that returns is
byte for byte what it writes and runs.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2

from orchestrate.core.errors import UserError
from orchestrate.core.layout import (
    CONTAINER_DIR,
    HEARTBEAT_DIR,
    SIDECAR_DIR,
    TRAIN_CONFIG,
    node_script_name,
)
from orchestrate.core.plan.launch import environment_bin, not_found
from orchestrate.core.plan.plan import NodePlan, Plan
from orchestrate.core.plan.ports import PORT_BASE, PORT_SPAN
from orchestrate.version import __version__


def quote(value: object) -> str:
    """Shell-quote any value (numbers too, so templates never reason about types).

    Backslashes are written outside the single quotes (``'a'\\'b'``): inside them a backslash
    before the closing quote reads like an attempt to escape it, which shellcheck flags
    (SC1003), and rendered scripts must pass shellcheck whatever a job file holds.
    """
    text = str(value)
    if text.startswith("="):  # `export X==y` is valid bash but reads like a typo (SC1097)
        return "'" + text.replace("'", "'\"'\"'") + "'" if "\\" not in text else \
            "'='" + quote(text[1:])
    if "\\" not in text:
        return shlex.quote(text)
    return "\\\\".join(shlex.quote(part) if part else "" for part in text.split("\\"))


#: What sbatch reads unquoted in an ``#SBATCH`` line.
_SBATCH_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


def sbatch_quote(value: object) -> str:
    """Quote a value for an ``#SBATCH`` line, which sbatch parses itself, not the shell.

    sbatch groups quoted text and lets a backslash escape any character (inside quotes too), so
    a double-quoted value with backslashes and quotes escaped arrives literally; shell quoting
    would lose its backslashes. Line breaks cannot be written at all: the renderer refuses them.
    """
    text = str(value)
    if _SBATCH_PLAIN.match(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def comment(value: object) -> str:
    """A value made safe for a ``#`` comment line: no line breaks or control characters."""
    return "".join(ch if ch.isprintable() else "?" for ch in str(value))


def builtin_templates() -> Path:
    """The templates shipped with the package (or the source tree's, in a checkout)."""
    packaged = Path(str(resources.files("orchestrate"))) / "templates"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[3] / "templates"


@lru_cache(maxsize=16)
def environment(templates_dir: Path | None = None) -> jinja2.Environment:
    """A Jinja environment: the job's own templates first, then the built-in ones. One per
    folder, kept: its templates are compiled once (30-40 ms for the node script) and compiled
    again only when their file changes (Jinja's ``auto_reload``). A local supervisor started
    before planning compiles the built-in ones while it waits (:mod:`orchestrate.backends.
    early`)."""
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
    env.filters["sq"] = sbatch_quote
    return env


def context(plan: Plan) -> dict[str, Any]:
    """What every template sees: the plan, and the constants the scripts name."""
    return {
        "plan": plan,
        "version": __version__,
        "port_base": PORT_BASE,
        "port_span": PORT_SPAN,
        "sidecar_dir": SIDECAR_DIR,
        "heartbeat_dir": HEARTBEAT_DIR,
        "container_dir": CONTAINER_DIR,
    }


@contextmanager
def _template_errors(templates_dir: Path | None) -> Iterator[None]:
    """A broken job template is the user's error, named with the templates folder."""
    try:
        yield
    except jinja2.TemplateError as exc:
        raise UserError.single(
            f"template error: {exc}",
            source=str(templates_dir or builtin_templates()),
            hint="check templates_dir: a job's own templates get the same variables",
        ) from None


def render_template(name: str, values: Mapping[str, Any], templates_dir: Path | None) -> str:
    """One template rendered with ``values`` (the job's own templates first)."""
    with _template_errors(templates_dir):
        return environment(templates_dir).get_template(name).render(values)


def node_scripts(plan: Plan, templates_dir: Path | None = None) -> dict[str, str]:
    """``launch-<node>.sh`` for every node: what the local and SSH backends run per rank (one
    template compiled once, however many nodes)."""
    base = context(plan)
    scripts = {}
    with _template_errors(templates_dir):
        template = environment(templates_dir).get_template("node.sh.j2")
        for node in plan.nodes:
            name = node_script_name(node.name)
            scripts[name] = template.render(base, node=node, script_name=name,
                                            start=node_start(node))
    return scripts


def node_start(node: NodePlan) -> dict[str, str | None]:
    """How a node's script finds its command: the node's Python environment's folder, looked
    in first (None when the inventory names no interpreter path), and what it says when the
    command is in neither that folder nor PATH. The script also exports ``SHLVL=2`` before it
    execs the command, so that a ``bash -c`` command (at level 2: exec lowers SHLVL by one, the
    new bash raises it by one) never reads ``~/.bashrc`` (bash does below level 2 when
    SSH_CLIENT is set or stdin is a socket, as under an SSH agent), which could put another
    python before this folder."""
    return {"bin": environment_bin(node.python),
            "missing": not_found(node.command[0], node.python)}


def train_config(plan: Plan) -> dict[str, str]:
    """``train.json`` for a ``train:`` job (what ``python -m orchestrate.train`` reads)."""
    if plan.train_config is None:
        return {}
    return {TRAIN_CONFIG: json.dumps(plan.train_config, indent=2, sort_keys=True) + "\n"}


def merged(files: Mapping[str, str]) -> str:
    """All rendered files as one text, each under a ``==> name <==`` header (like ``tail``)."""
    parts = []
    for name, text in files.items():
        parts.append(f"==> {name} <==\n{text}")
    return "\n".join(parts)
