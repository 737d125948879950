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

PROBE_TESTS = Path(__file__).resolve().parents[2] / "probe"


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


def fake_nvidia_smi(folder: Path, gpus: list[tuple[int, str, int]],
                    apps: list[tuple[int, str, int, int]] | None = None) -> Path:
    """A stand-in ``nvidia-smi`` (GPUs cannot exist here): tests/probe/fake_nvidia_smi.py
    replaying these GPUs (index, name, memory.total MiB) and compute processes (pid, process
    name, GPU index, used MiB), in nvidia-smi's own CSV format (that file says where the
    format comes from). Run by the system Python, so that every user can run it."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "nvsmi"
    data.mkdir(exist_ok=True)
    rows = "".join(f"{i}, GPU-{i:08d}-0000-0000-0000-000000000000, 00000000:{16 + i:02X}:00.0, "
                   f"{name}, {mib}, 0\n" for i, name, mib in gpus)
    (data / "query.csv").write_text("index, uuid, pci.bus_id, name, memory.total [MiB], "
                                    "utilization.gpu [%]\n" + rows)
    set_compute_apps(folder, apps or [])
    script = folder / "nvidia-smi"
    script.write_text("#!/usr/bin/python3\nimport os\n"
                      f"os.environ.setdefault('FAKE_NVSMI_DIR', {str(data)!r})\n"
                      + (PROBE_TESTS / "fake_nvidia_smi.py").read_text())
    script.chmod(0o755)
    for path in (folder, data, *data.iterdir()):
        path.chmod(path.stat().st_mode | 0o055)
    return folder


def set_compute_apps(folder: Path, apps: list[tuple[int, str, int, int]]) -> None:
    """What the stand-in of :func:`fake_nvidia_smi` lists as compute processes from now on:
    ``(pid, process name, GPU index, used MiB)``."""
    rows = "".join(f"{pid}, {name}, GPU-{gpu:08d}-0000-0000-0000-000000000000, "
                   f"00000000:{16 + gpu:02X}:00.0, {mib}\n" for pid, name, gpu, mib in apps)
    path = folder / "nvsmi" / "apps.csv"
    path.write_text("pid, process_name, gpu_uuid, gpu_bus_id, used_gpu_memory [MiB]\n" + rows)
    path.chmod(0o644)
