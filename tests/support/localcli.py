"""The real ``python -m orchestrate`` CLI on this machine (the local backend), with a private
ORCHESTRATE_HOME in a work folder; the fixture ``cli`` (tests/conftest.py) makes one per test."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Cli:
    """Runs ``python -m orchestrate`` with a private ORCHESTRATE_HOME in a work folder."""

    home: Path
    work: Path
    env: dict[str, str]
    uid: str

    def id(self, name: str) -> str:
        """A job id unique to this test run: processes are found (and reaped) by job id, so
        ids must not repeat across runs that share a machine."""
        return f"{name}-{self.uid}"

    def run(self, *args: str, timeout: float = 120, check: bool = False,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "orchestrate", *args],
            cwd=self.work, env=self.env, capture_output=True, text=True, timeout=timeout,
            **kwargs,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"orchestrate {args} exited {proc.returncode}:\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "orchestrate", *args], cwd=self.work, env=self.env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    def status(self, job: str) -> dict[str, Any]:
        out = self.run("status", job, "--json", check=True).stdout
        result: dict[str, Any] = json.loads(out)
        return result

    def write(self, name: str, text: str) -> Path:
        path = self.work / name
        path.write_text(textwrap.dedent(text))
        return path
