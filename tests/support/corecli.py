"""Helpers for the core's tests: run the real CLI, write job files, compare goldens.

The CLI runs in-process through :func:`orchestrate.cli.main` (what ``orchestrate`` and
``python -m orchestrate`` call) for speed, and as a real process where the exit status and
stderr of a separate interpreter are the point (no traceback ever reaches a user).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrate.cli import main

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "tests" / "core"
INVENTORIES = REPO / "inventory"
TEST_INVENTORIES = CORE / "inventories"
GOLDEN = CORE / "golden"
UPDATE_GOLDEN = os.environ.get("ORCHESTRATE_UPDATE_GOLDEN") == "1"
SHELLCHECK = "/usr/bin/shellcheck"


@dataclass(frozen=True)
class Result:
    """What a person sees: the exit status, standard output and standard error."""

    code: int
    out: str
    err: str


def cli(*args: str | Path, cwd: Path | None = None) -> Result:
    """Run ``orchestrate ARGS`` in this process, as the console script does."""
    out, err = io.StringIO(), io.StringIO()
    old = Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in args])
    finally:
        os.chdir(old)
    return Result(code, out.getvalue(), err.getvalue())


def cli_process(*args: str | Path, cwd: Path | None = None, timeout: float = 60) -> Result:
    """Run ``python -m orchestrate ARGS`` as a separate process."""
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrate", *[str(a) for a in args]],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def write_yaml(path: Path, data: Mapping[str, Any]) -> Path:
    """Write ``data`` as a YAML file (creating folders) and return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dict(data), sort_keys=False), encoding="utf-8")
    return path


def compare_golden(name: str, actual: str) -> None:
    """Compare ``actual`` with ``golden/NAME`` exactly; a readable diff on mismatch.

    ``ORCHESTRATE_UPDATE_GOLDEN=1`` rewrites the file instead (then review the git diff).
    """
    path = GOLDEN / name
    if UPDATE_GOLDEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual, encoding="utf-8")
        return
    if not path.exists():
        pytest.fail(f"golden file {path} is missing; run with ORCHESTRATE_UPDATE_GOLDEN=1")
    expected = path.read_text(encoding="utf-8")
    if actual != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                actual.splitlines(keepends=True),
                fromfile=f"golden/{name}",
                tofile="rendered now",
            )
        )
        pytest.fail(
            f"{name} differs from its golden file (ORCHESTRATE_UPDATE_GOLDEN=1 rewrites it "
            f"after a deliberate change):\n{diff}",
            pytrace=False,
        )


def shellcheck(*scripts: Path) -> None:
    """Fail (never skip) unless every script passes shellcheck and ``bash -n``."""
    if shutil.which(SHELLCHECK) is None and shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed (apt-get install shellcheck); it is required")
    exe = SHELLCHECK if Path(SHELLCHECK).exists() else "shellcheck"
    proc = subprocess.run(
        [exe, "--shell=bash", "--severity=style", *map(str, scripts)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, f"shellcheck found problems:\n{proc.stdout}{proc.stderr}"
    for script in scripts:
        syntax = subprocess.run(
            ["bash", "-n", str(script)], capture_output=True, text=True, check=False
        )
        assert syntax.returncode == 0, f"bash -n {script}: {syntax.stderr}"


def normalise(text: str) -> str:
    """Machine-dependent values (this interpreter's path) as placeholders, for goldens; a
    shipped program (the Slurm monitor: modules of this package bundled into one text) as one
    line naming its modules, and each file of the rank sidecar's folder as one line, since
    their own tests cover their text."""
    from orchestrate.backends.base import PLACE_CHECK, place_check_program
    from orchestrate.backends.slurm.script import MONITOR, monitor_program
    from orchestrate.backends.ssh.backend import EVIDENCE, evidence_program
    from orchestrate.diagnosis.rankpackage import folder

    shipped = {
        monitor_program(): f"<orchestrate.hostside.shipping.program{MONITOR.names}>\n",
        evidence_program(): f"<orchestrate.hostside.shipping.program{EVIDENCE.names}>\n",
        shlex.quote(place_check_program()):
            f"<compacted orchestrate.hostside.shipping.program{PLACE_CHECK.names}>",
    }
    for name, source in folder().items():
        shipped[source] = f"<{name} of orchestrate.diagnosis.rankpackage.folder()>\n"
    text = text.replace(sys.executable, "$PYTHON")
    # Its folder too: commands are looked up in the node's Python environment first.
    text = text.replace(os.path.dirname(sys.executable), "$PYTHON_BIN")
    for program, shown in shipped.items():
        text = text.replace(program, shown)
    return text
