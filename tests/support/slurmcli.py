"""``python -m orchestrate`` against the Slurm test cluster (tests/support/slurmcluster.py), with
a private job store; the fixture ``ocli`` (tests/conftest.py) makes one per test."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.slurmcluster import SlurmCluster

#: What ``submit`` says on stderr once the job is recorded (orchestrate/cli/jobs.py).
SUBMITTED = re.compile(r"^job (\S+) submitted \(", re.MULTILINE)


def submitted_id(proc: subprocess.CompletedProcess[str]) -> str:
    """The id of the job a ``submit`` announced; an error showing its output if it named none."""
    found = SUBMITTED.search(proc.stderr)
    if found is None:
        raise AssertionError(f"submit named no job (exit {proc.returncode}):\n{proc.stdout}\n"
                             f"{proc.stderr}")
    return found.group(1)


#: The digits example trained on 2 nodes with checkpoints and restarts, as the requeue and
#: restart tests submit it: ``.format(name=..., workdir=<examples/digits>)``.
TRAIN_JOB = """\
name: {name}
inventory: inventory.yaml
backend: slurm
resources: {{nodes: 2, gpus_per_node: 1, time: "10"}}
workdir: {workdir}
train:
  model: digits:build_model
  model_args: {{hidden: 64}}
  dataset: digits:build_dataset
  optimizer: {{name: adamw, lr: 3.0e-3}}
  epochs: 6
  batch_size: 32
  seed: 777
  checkpoint_every_steps: 20
distributed: {{timeout_s: 60}}
restart: {{max: 2}}
"""


@dataclass
class OrchestrateCli:
    """``python -m orchestrate`` with a private job store, pointed at the test cluster.

    ``work`` holds the job files and the inventory; run directories go to ``work/runs`` (a
    path every node sees: the nodes share this machine's file system, as a cluster shares one).
    """

    cluster: SlurmCluster
    home: Path
    work: Path
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 120, check: bool = False,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "orchestrate", *args], cwd=self.work, env=env or self.env,
            capture_output=True, text=True, timeout=timeout, check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"orchestrate {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n"
                f"{proc.stderr}"
            )
        return proc

    def submit(self, job: Path, *args: str) -> str:
        """Submit detached; the job id."""
        return self.run("submit", str(job), "--detach", *args, check=True).stdout.strip()

    def submitted(self, job: Path, states: Collection[str], timeout: float = 90
                  ) -> tuple[str, dict[str, Any]]:
        """Submit ``job`` detached and wait until it is in one of ``states``: its id and status."""
        job_id = self.submit(job)
        return job_id, self.wait(job_id, states, timeout)

    def followed(self, job: Path, timeout: float) -> tuple[subprocess.CompletedProcess[str], str]:
        """``submit --follow`` to the job's end: the process, and the id of the job it
        submitted (from its ``job <id> submitted (...)`` line)."""
        proc = self.run("submit", str(job), "--follow", timeout=timeout)
        return proc, submitted_id(proc)

    def status(self, job: str) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.run("status", job, "--json", check=True).stdout)
        return result

    def wait(self, job: str, states: Collection[str], timeout: float = 90) -> dict[str, Any]:
        """Poll ``orchestrate status`` until the job is in one of ``states``."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status(job)
            if status["state"] in states:
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job} not in {sorted(states)} after {timeout}s: "
                                     f"{status['state']} ({status['reason']})\n"
                                     + self.run("logs", job).stdout[-3000:])
            time.sleep(0.3)

    def write(self, name: str, text: str) -> Path:
        path = self.work / name
        path.write_text(textwrap.dedent(text))
        return path

    def inventory(self, name: str = "inventory.yaml", slots: Mapping[str, int] | None = None
                  ) -> Path:
        """The test cluster as an inventory: CPU nodes, partition debug, this interpreter."""
        interface = "eth0" if self.cluster.layout == "netns" else "lo"
        nodes = "\n".join(
            f"  - {{name: {n}, slots: {(slots or {}).get(n, 4)}}}" for n in self.cluster.nodes
        )
        return self.write(name, f"""\
name: test-slurm
defaults:
  python: {sys.executable}
  cpus: 4
  network: {{interface: {interface}}}
  slurm: {{partition: debug}}
nodes:
{nodes}
""")

