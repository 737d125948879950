"""The real Slurm test cluster (tests/clusters/slurm.sh): what a test needs to talk to it, and
its bring-up, the body of the session fixture ``slurm_cluster`` (tests/conftest.py).

Why a fixture that brings the cluster up itself: the Slurm tests must prove the backend works
against real slurmctld/slurmd daemons, so a missing cluster is a failure, never a skip. A cluster
that was already up before the session (a developer's `slurm.sh up`) is used and left running.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrate.backends.slurm.ctl import parse_show_job

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "clusters" / "slurm.sh"
STATE_DIR = Path(os.environ.get("ORCHESTRATE_SLURM_DIR", "/tmp/orchestrate-slurm"))

#: Slurm job states after which a job never runs again (requeue aside).
FINISHED = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)


@dataclass(frozen=True)
class SlurmCluster:
    """What a test needs to talk to the cluster: the clients' env, the nodes, the state dir."""

    state_dir: Path
    nodes: tuple[str, ...]
    env: dict[str, str]  # os.environ plus SLURM_CONF (from $state_dir/env.sh)
    layout: str  # "netns": one network namespace per node; "loopback": 127.0.1.K addresses

    @property
    def slurm_conf(self) -> Path:
        return Path(self.env["SLURM_CONF"])

    def run(
        self, *args: str, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client (sbatch, scontrol, ...) against this cluster."""
        return subprocess.run(
            args, env=self.env, capture_output=True, text=True, check=check, timeout=timeout
        )

    def sbatch(self, script: Path, *options: str) -> str:
        """Submit a batch script; return the job id."""
        self.heal()
        out = self.run("sbatch", "--parsable", *options, str(script)).stdout.strip()
        return out.split(";")[0]

    def heal(self) -> None:
        """Resume a node slurmd drained because an earlier test's step did not end within
        UnkillableStepTimeout ("Kill task failed"), so one stuck step fails its own test, not
        every later one. Said on stderr (pytest shows it with the test), never silent."""
        listing = self.run("sinfo", "-h", "-N", "-o", "%N|%T|%E", check=False).stdout
        drained = sorted({line.split("|")[0] for line in listing.splitlines()
                          if line.count("|") == 2 and "Kill task failed" in line.split("|")[2]})
        for node in drained:
            print(f"slurm test cluster: resuming {node}, drained by slurmd (Kill task failed)",
                  file=sys.stderr)
            self.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
        deadline = time.monotonic() + 30
        while drained and time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
            if all(states[states.index(n) + 1] in ("idle", "mixed", "allocated")
                   for n in drained if n in states):
                return
            time.sleep(0.5)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict; works after the job ended (MinJobAge=3600)."""
        text = self.run("scontrol", "show", "job", job_id).stdout
        records = parse_show_job(text)  # a job name or comment may hold " JobState=..."
        return next((r for r in records if r.get("JobId") == job_id), {})

    def wait(
        self, job_id: str, until: frozenset[str] = FINISHED, timeout: float = 60
    ) -> dict[str, str]:
        """Poll `scontrol show job` until the job's state is in `until`; return its fields."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in until:
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job_id} not in {sorted(until)} after {timeout}s: {fields}"
                )
            time.sleep(0.2)


def _script(command: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), command], capture_output=True, text=True, timeout=timeout, check=False
    )


def _read_env_sh(path: Path) -> dict[str, str]:
    """The `export NAME=value` lines that slurm.sh writes, without running a shell."""
    exported: dict[str, str] = {}
    for line in path.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, _, value = words[1].partition("=")
            exported[name] = value
    return exported



def cluster_up() -> Iterator[SlurmCluster]:
    """The test cluster for the whole session: brought up unless it already was, and then
    brought down again."""
    was_up = _script("status", timeout=30).returncode == 0
    started = time.monotonic()
    up = _script("up", timeout=600)
    if up.returncode != 0:
        pytest.fail(
            f"tests/clusters/slurm.sh up failed (exit {up.returncode}):\n{up.stdout}\n{up.stderr}",
            pytrace=False,
        )
    print(f"\nslurm cluster up in {time.monotonic() - started:.2f}s: {up.stdout.strip()}")
    exported = _read_env_sh(STATE_DIR / "env.sh")
    conf = Path(exported["SLURM_CONF"]).read_text()
    layout = "loopback" if "NodeAddr=127." in conf else "netns"
    try:
        yield SlurmCluster(
            state_dir=STATE_DIR,
            nodes=tuple(exported["ORCHESTRATE_SLURM_NODES"].split()),
            env={**os.environ, **exported},
            layout=layout,
        )
    finally:
        if not was_up:
            down = _script("down", timeout=120)
            assert down.returncode == 0, f"slurm.sh down failed:\n{down.stdout}\n{down.stderr}"


