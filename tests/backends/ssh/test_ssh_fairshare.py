"""Multi-host jobs waiting on the same SSH hosts (issue #36): each claims host by host in one
global order and stops at the first refusal, so two 2-host jobs that wait for the same two
hosts never each hold one and wait for ever; both run, in turn."""

from __future__ import annotations

import pytest

from tests.support.sshcli import SshCli, assert_nothing_left

pytestmark = pytest.mark.ssh


@pytest.mark.timeout(240)
def test_two_waiting_two_host_jobs_on_the_same_hosts_both_run_in_turn(ssh_cli: SshCli) -> None:
    book = ssh_cli.work / "gangbook"
    ssh_cli.inventory([{"name": n, "slots": 1, "lease_dir": str(book)} for n in ("h1", "h2")])
    job = ssh_cli.write("gang.yaml", """
        name: gang
        backend: ssh
        inventory: inv.yaml
        resources: {nodes: 2, gpus_per_node: 1}
        command: [bash, -c, "sleep 300"]
        """)
    ssh_cli.run("submit", str(job), "--detach", "--job-id", "gang-a", check=True)
    ssh_cli.wait_running("gang-a")
    for waiter in ("gang-b", "gang-c"):
        ssh_cli.run("submit", str(job), "--detach", "--job-id", waiter, "--wait", check=True)
    for waiter in ("gang-b", "gang-c"):
        assert ssh_cli.status(waiter)["state"] == "PENDING"
    ssh_cli.run("cancel", "gang-a", check=True)
    ssh_cli.wait_running("gang-b", timeout=60)
    waiting = ssh_cli.status("gang-c")
    assert waiting["state"] == "PENDING" and "gang-b" in str(waiting["reason"]), waiting
    ssh_cli.run("cancel", "gang-b", check=True)
    ssh_cli.wait_running("gang-c", timeout=60)
    ssh_cli.run("cancel", "gang-c", check=True)
    for done in ("gang-a", "gang-b", "gang-c"):
        assert_nothing_left(ssh_cli, done)
