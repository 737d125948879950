"""Multi-host jobs waiting on the same SSH hosts (issue #36): each claims host by host in one
global order and stops at the first refusal, so two 2-host jobs that wait for the same two
hosts never each hold one and wait for ever; both run, in turn. And the admin's limits and
``orchestrate queue --inventory`` over SSH."""

from __future__ import annotations

import json
import time

import pytest

from tests.support.labserver import gpu_node, gpu_python, lease_book
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


@pytest.mark.timeout(120)
def test_a_hosts_policy_refuses_over_ssh_naming_the_rule_and_the_queue_asks_every_host(
        ssh_cli: SshCli) -> None:
    """policy.json beside h1's book (root's, as an admin writes it) caps a user at 1 GPU: a
    second 1-GPU job is refused naming the rule; ``queue --inventory`` shows h1's running job
    with its time limit's end and names the host that does not answer (at once, no hang)."""
    wrapper = gpu_python(ssh_cli)
    book = lease_book(ssh_cli).parent
    book.mkdir(parents=True, exist_ok=True)
    (book / "policy.json").write_text(json.dumps({"max_gpus_per_user": 1}))
    (book / "policy.json").chmod(0o644)
    inventory = ssh_cli.inventory(
        [gpu_node(ssh_cli), {"name": "h9", "slots": 1, "address": "127.0.0.1",
                             "ssh": {"port": 1}, "lease_dir": str(book)}], python=wrapper)
    job = ssh_cli.write("capped.yaml", """
        name: capped
        backend: ssh
        inventory: inv.yaml
        resources: {nodes: 1, gpus_per_node: 1, gpu_model: A100-80GB, time: "30"}
        distributed: {backend: gloo}
        command: [bash, -c, "sleep 300"]
        """)
    ssh_cli.run("submit", str(job), "--detach", "--job-id", "capped-1", check=True)
    ssh_cli.wait_running("capped-1")
    refused = ssh_cli.run("submit", str(job), "--detach", "--job-id", "capped-2")
    assert refused.returncode == 75, refused.stderr
    assert "policy max_gpus_per_user: 1 (" in refused.stderr and "policy.json" in refused.stderr
    started = time.monotonic()
    shown = ssh_cli.run("queue", "--json", "--inventory", str(inventory), check=True)
    assert time.monotonic() - started < 60
    merged = json.loads(shown.stdout)
    [running] = merged["running"]
    assert running["job_id"] == "capped-1" and len(running["hosts"]) == 1
    assert running["until"] > time.time() + 25 * 60  # its 30-minute limit, from its claim
    [h1, h9] = merged["hosts"]
    assert not h1["no_answer"] and h1["policy"]["max_gpus_per_user"] == 1
    assert h9["node"] == "h9" and h9["no_answer"]
    text = ssh_cli.run("queue", "--inventory", str(inventory), check=True).stdout
    assert "h9: no answer: " in text and "capped-1" in text
    ssh_cli.run("cancel", "capped-1", check=True)
    assert_nothing_left(ssh_cli, "capped-1")
