"""Lightning Fabric, the Lightning Trainer and accelerate on real sshd hosts: 2 nodes x 1 rank,
and 2 + 1 ranks (accelerate runs it; Lightning's torchrun environment cannot, and `plan` says so
before anything starts)."""

from __future__ import annotations

import json

import pytest

from tests.support.frameworkprobes import PROBES, assert_believes_plan, copy_probes, job_text
from tests.support.sshcli import SshCli
from tests.support.sshhosts import tagged_on

pytestmark = [pytest.mark.ssh, pytest.mark.torch, pytest.mark.frameworks,
              pytest.mark.usefixtures("no_stray_remote_processes")]

RUN = 300  # ranks importing torch and Lightning on a small shared machine


def _run_probe(ssh_cli: SshCli, probe: str, job_id: str, resources: str) -> None:
    copy_probes(ssh_cli.work)
    job = ssh_cli.write("probe.yaml", job_text(probe, probe, "ssh", resources, "inv.yaml"))
    plan = json.loads(
        ssh_cli.run("plan", str(job), "--json", "--job-id", job_id, check=True).stdout)
    proc = ssh_cli.run("submit", str(job), "--follow", "--job-id", job_id, timeout=RUN - 30)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr
    records = assert_believes_plan(proc.stdout, plan, probe, "TorchElasticEnvironment",
                                   launcher=" -S -c ")  # the agent each rank's login runs
    assert {r["env"]["TORCHELASTIC_RUN_ID"] for r in records.values()} == {job_id}
    assert tagged_on(ssh_cli.hosts, job_id) == {}  # nothing of the job left on any host


@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.timeout(RUN)
def test_two_hosts_one_rank_each(ssh_cli: SshCli, probe: str) -> None:
    ssh_cli.inventory([{"name": "h1", "slots": 1}, {"name": "h2", "slots": 1}])
    _run_probe(ssh_cli, probe, f"{probe}-2x1", "{nodes: 2, gpus_per_node: 1}")


@pytest.mark.timeout(RUN)
def test_accelerate_on_two_plus_one(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": "h1", "slots": 2}, {"name": "h2", "slots": 1}])
    _run_probe(ssh_cli, "accelerate", "accelerate-2p1", "{nodes: 2, gpus_per_node: all}")


@pytest.mark.parametrize("probe", ["fabric", "trainer"])
def test_lightning_on_two_plus_one_is_refused_before_any_login(ssh_cli: SshCli,
                                                               probe: str) -> None:
    ssh_cli.inventory([{"name": "h1", "slots": 2}, {"name": "h2", "slots": 1}])
    job = ssh_cli.write("probe.yaml", job_text(probe, probe, "ssh",
                                               "{nodes: 2, gpus_per_node: all}", "inv.yaml"))
    proc = ssh_cli.run("submit", str(job), "--follow", "--job-id", f"{probe}-2p1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "different rank counts (h1: 2, h2: 1)" in proc.stderr
    assert "hint: give every node the same count (resources.gpus_per_node)" in proc.stderr
    assert not (ssh_cli.work / "runs").exists() or not any((ssh_cli.work / "runs").iterdir())
