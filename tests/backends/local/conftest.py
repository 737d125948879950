"""Fixtures for the local backend: a private job store and a runner for the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from orchestrate.hostside import host


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


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    home = tmp_path / "home"
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, ORCHESTRATE_HOME=str(home), ORCHESTRATE_RUNS=str(work / "runs"))
    env.pop("ORCHESTRATE_JOB_ID", None)
    c = Cli(home=home, work=work, env=env, uid=uuid.uuid4().hex[:6])
    yield c
    # Whatever a test leaves behind is a failure of that test, but never of the next one.
    for run in (work / "runs").glob("*") if (work / "runs").exists() else []:
        host.reap(run.name, 1.0)


def fake_nvidia_smi(folder: Path, gpus: list[tuple[int, str, int]]) -> Path:
    """A stand-in ``nvidia-smi`` (GPUs cannot exist here) answering the planner's query: the
    GPUs' index, name and memory, under nvidia-smi's CSV header (unless ``noheader``), which
    names the columns it answers."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    rows = "\\n".join(f"{i}, {name}, {mib}" for i, name, mib in gpus)
    header = "index, name, memory.total [MiB]"
    script.write_text(f"#!/bin/sh\ncase \"$*\" in *noheader*) ;; *) echo '{header}' ;; esac\n"
                      f"printf '{rows}\\n'\n")
    script.chmod(0o755)
    return folder
