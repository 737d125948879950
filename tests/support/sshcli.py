"""The real ``python -m orchestrate`` CLI pointed at the SSH test hosts (tests/support/sshhosts.py),
with a private job store; the fixture ``ssh_cli`` (tests/conftest.py) makes one per test; and the
check that a job left no process on any host."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.sshhosts import SshHosts, tagged_by_namespace, tagged_on


@dataclass
class SshCli:
    """Runs the real `python -m orchestrate` CLI with a private ORCHESTRATE_HOME, and writes
    inventories that reach the test hosts the way a user's would."""

    hosts: SshHosts
    home: Path
    work: Path
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 120, check: bool = False
            ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "orchestrate", *args], cwd=self.work, env=self.env,
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"orchestrate {args} exited {proc.returncode}:\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def status(self, job: str) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.run("status", job, "--json", check=True).stdout)
        return result

    def wait_state(self, job: str, states: set[str], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            status = self.status(job)
            if status["state"] in states or time.monotonic() > deadline:
                return status
            time.sleep(0.2)

    def wait_running(self, job: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.run("status", job).returncode != 0:  # still in preflight: not a job yet
                time.sleep(0.2)
                continue
            status = self.status(job)
            if status["state"] == "RUNNING" and all(r["pid"] for r in status["ranks"]):
                return status
            if status["state"] not in ("PENDING", "RUNNING"):
                break
            time.sleep(0.2)
        raise AssertionError(f"job {job} never ran all ranks: {self.status(job)}")

    def submitted(self, job: Path, job_id: str, timeout: float = 60) -> dict[str, Any]:
        """Submit ``job`` detached as ``job_id`` and wait until every rank runs: its status."""
        self.run("submit", str(job), "--detach", "--job-id", job_id, check=True)
        return self.wait_running(job_id, timeout)

    def write(self, name: str, text: str) -> Path:
        path = self.work / name
        path.write_text(textwrap.dedent(text))
        return path

    def inventory(self, nodes: list[dict[str, Any]], name: str = "inv.yaml",
                  python: str = sys.executable, **ssh: Any) -> Path:
        """An inventory of test hosts: each node a dict with at least `name` (h1..) and `slots`
        or `gpus`; the address comes from the running hosts unless given. JSON is YAML."""
        addresses = dict(self.hosts.hosts)
        settings = {
            "config_file": str(self.hosts.ssh_config),
            "known_hosts_file": str(self.hosts.known_hosts),
            "identity_file": str(self.hosts.key),
            **ssh,
        }
        entries = [{"address": addresses.get(n["name"]), **n} for n in nodes]
        data = {"name": "test-hosts", "defaults": {"python": python, "ssh": settings},
                "nodes": entries}
        path = self.work / name
        path.write_text(json.dumps(data, indent=2) + "\n")
        return path


def assert_nothing_left(cli: SshCli, job_id: str) -> None:
    """No process of the job on any host, asked on each host over ssh and counted from here by
    PID namespace; what is left is shown (root-namespace pids)."""
    asked = tagged_on(cli.hosts, job_id)
    seen = tagged_by_namespace(cli.hosts, job_id)
    if asked or seen:
        pids = ",".join(str(p) for ps in seen.values() for p in ps) or "0"
        ps = subprocess.run(["ps", "-o", "pid,ppid,stat,cmd", "-p", pids],
                            capture_output=True, text=True).stdout
        raise AssertionError(f"processes of {job_id} left: hosts say {asked}; by namespace "
                             f"{seen}:\n{ps}")
