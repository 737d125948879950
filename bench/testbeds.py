"""The test hosts and the test cluster the benchmarks run on, brought up as the tests bring
them up (tests/clusters/sshhosts.sh, tests/clusters/slurm.sh), and the inventories that name
them. One place, so that every SSH or Slurm bench measures the same set-up."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SSH_SCRIPT = ROOT / "tests" / "clusters" / "sshhosts.sh"
SLURM_SCRIPT = ROOT / "tests" / "clusters" / "slurm.sh"
SSH_STATE = Path(os.environ.get("ORCHESTRATE_SSH_DIR", "/tmp/orchestrate-sshhosts"))
SLURM_STATE = Path(os.environ.get("ORCHESTRATE_SLURM_DIR", "/tmp/orchestrate-slurm"))


def ssh_hosts_up(count: int) -> bool:
    """Bring up at least ``count`` SSH test hosts; True if this call started them (the caller
    then takes them down with :func:`ssh_hosts_down`)."""
    if len(ssh_hosts()) >= count:
        return False
    subprocess.run(["bash", str(SSH_SCRIPT), "up", str(count)], check=True, capture_output=True)
    return True


def ssh_hosts_down() -> None:
    subprocess.run(["bash", str(SSH_SCRIPT), "down"], check=False, capture_output=True)


def ssh_hosts(count: int | None = None) -> list[tuple[str, str]]:
    """The running test hosts' (name, address), in order (the first ``count``)."""
    listed = SSH_STATE / "hosts.txt"
    rows = [line.split() for line in listed.read_text().splitlines()] if listed.exists() else []
    hosts = [(row[0], row[1]) for row in rows if len(row) >= 2]
    return hosts if count is None else hosts[:count]


def ssh_settings() -> dict[str, str]:
    """The inventory's ``ssh:`` settings that reach the test hosts."""
    return {"config_file": str(SSH_STATE / "ssh_config"),
            "known_hosts_file": str(SSH_STATE / "known_hosts"),
            "identity_file": str(SSH_STATE / "id_ed25519")}


def ssh_inventory(count: int) -> dict[str, Any]:
    """An inventory of the first ``count`` test hosts, one slot each, this python."""
    return {
        "name": "bench",
        "defaults": {"python": sys.executable, "ssh": ssh_settings()},
        "nodes": [{"name": name, "address": address, "slots": 1}
                  for name, address in ssh_hosts(count)],
    }


def slurm_up() -> None:
    """Start the test cluster unless it runs."""
    running = subprocess.run(["bash", str(SLURM_SCRIPT), "status"], capture_output=True,
                             check=False).returncode == 0
    if not running:
        subprocess.run(["bash", str(SLURM_SCRIPT), "up"], check=True, capture_output=True)


def slurm_env(state: Path = SLURM_STATE) -> dict[str, str]:
    """The variables that point Slurm's commands at the test cluster (its env.sh exports;
    ``state``: another cluster's state dir, such as the 24.11 one's)."""
    env: dict[str, str] = {}
    for line in (state / "env.sh").read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export":
            name, _, value = words[1].partition("=")
            env[name] = value
    return env
