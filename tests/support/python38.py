"""The Python 3.8 that the tests run shipped programs with (nodes may have only 3.8).

pyenv's shim for ``python3.8`` is on PATH even where 3.8 is not selected, so a candidate counts
only once it runs and says it is 3.8. Asked once per test session.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path


@functools.cache
def python38() -> str | None:
    """A runnable Python 3.8 interpreter, or None where this machine has none."""
    candidates = [*map(str, sorted(Path("/root/.pyenv/versions").glob("3.8*/bin/python3.8"))),
                  shutil.which("python3.8") or ""]
    for exe in filter(None, candidates):
        try:
            probe = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"],
                                   capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0 and probe.stdout.strip() == "(3, 8)":
            return exe
    return None
