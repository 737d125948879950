"""Plans into scripts, through Jinja templates that hold layout only.

Every value reaches a script through the ``q`` filter (POSIX shell quoting), and ``comment``
keeps a value on its comment line, so nothing in a job or inventory file can inject a command.
``StrictUndefined`` makes a misspelled variable an error instead of an empty string. What
:func:`render` returns is byte for byte what the backends write and run.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2

from orchestrate import __version__
from orchestrate.allocation import slurm_layout
from orchestrate.errors import UserError
from orchestrate.layout import (
    EVIDENCE_PROGRAM,
    HEARTBEAT_DIR,
    LOG_DIR,
    MERGED_LOG,
    SBATCH_SCRIPT,
    SIDECAR_DIR,
    SIDECAR_FILE,
    SLURM_BATCH_LOG,
    SLURM_EVENTS,
    SLURM_EXITS,
    SLURM_HOSTFILE,
    SLURM_MERGE_OFFSETS,
    SLURM_MONITOR,
    SLURM_STATE,
    TRAIN_CONFIG,
    node_script_name,
)
from orchestrate.plan import Plan
from orchestrate.ports import PORT_BASE, PORT_SPAN
from orchestrate.shipping import module_source, program

#: What reads the ranks' heartbeats and dumps and names a stuck rank (stdlib only).
EVIDENCE_MODULES = ("orchestrate.layout", "orchestrate.stall", "orchestrate.evidence")
#: The modules of the Slurm batch job's monitor program (monitor.py in the run directory): it
#: also runs the stall watch beside the ranks.
MONITOR_MODULES = ("orchestrate.exits", "orchestrate.outcome", "orchestrate.restart",
                   *EVIDENCE_MODULES, "orchestrate.hangwatch",
                   "orchestrate.backends.slurmmonitor")


def monitor_program() -> str:
    """``monitor.py``: the Slurm batch job's monitor, shipped beside job.sbatch."""
    return program(MONITOR_MODULES, "from orchestrate.backends.slurmmonitor import main\n"
                                    "sys.exit(main(sys.argv[1:]))")


def evidence_program() -> str:
    """``evidence.py``: what an SSH host runs to read its ranks' heartbeats and dumps."""
    return program(EVIDENCE_MODULES, "from orchestrate.evidence import main\n"
                                     "sys.exit(main(sys.argv[1:]))")


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
    env.filters["sq"] = sbatch_quote
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
        "sidecar_dir": SIDECAR_DIR,
        "heartbeat_dir": HEARTBEAT_DIR,
    }
    if plan.backend == "slurm" and not (plan.run_dir.isprintable() and "\\" not in plan.run_dir):
        # The run directory is part of an #SBATCH line (--output), which sbatch reads alone.
        raise UserError.single(
            "the run directory cannot go into an #SBATCH line (line break, control character "
            "or backslash)",
            field="run_root",
            got=plan.run_dir,
            hint="choose a run_root without them (or set $ORCHESTRATE_RUNS)",
        )
    try:
        if plan.backend == "slurm":
            files[SBATCH_SCRIPT] = env.get_template("sbatch.sh.j2").render(
                context, **slurm_context(plan)
            )
            files[SLURM_MONITOR] = monitor_program()
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
    files[SIDECAR_FILE] = module_source("orchestrate.sidecar")
    if plan.backend == "ssh":
        files[EVIDENCE_PROGRAM] = evidence_program()
    if plan.train_config is not None:
        files[TRAIN_CONFIG] = json.dumps(plan.train_config, indent=2, sort_keys=True) + "\n"
    return files


def slurm_context(plan: Plan) -> dict[str, Any]:
    """What sbatch.sh.j2 lays out beyond the plan: the allocation, the run dir's file names."""
    return {
        "slurm": slurm_layout(plan),
        "files": {
            "script": SBATCH_SCRIPT,
            "merged": MERGED_LOG,
            "log_dir": LOG_DIR,
            "state": SLURM_STATE,
            "events": SLURM_EVENTS,
            "exits": SLURM_EXITS,
            "hostfile": SLURM_HOSTFILE,
            "merge_offsets": SLURM_MERGE_OFFSETS,
            "batch_log": SLURM_BATCH_LOG,
            "monitor": SLURM_MONITOR,
        },
    }


def merged(files: Mapping[str, str]) -> str:
    """All rendered files as one text, each under a ``==> name <==`` header (like ``tail``)."""
    parts = []
    for name, text in files.items():
        parts.append(f"==> {name} <==\n{text}")
    return "\n".join(parts)
