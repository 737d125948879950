"""A shared server reached over SSH (issue #20, #25 item 5): the host's agent respects GPUs that
processes outside orchestrate use, ``gpus --inventory`` names every holder through it, and a
rank's double-forked daemon that drops the job tag does not outlive its job on the host (the
agent is a child subreaper).

h1 has the lab server's GPUs through the inventory's python wrapper (the stand-in nvidia-smi);
its "foreign" process is a real process started on h1 (h1's pid, as nvidia-smi there says).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support.fakesmi import set_compute_apps
from tests.support.labserver import gpu_node, gpu_python
from tests.support.sshcli import SshCli, assert_nothing_left

pytestmark = pytest.mark.ssh


def _on_h1(cli: SshCli, command: str) -> int:
    started = cli.hosts.run("h1", f"setsid {command} </dev/null >/dev/null 2>&1 & echo $!")
    assert started.returncode == 0, started.stderr
    return int(started.stdout.split()[-1])


@pytest.mark.timeout(150)
def test_a_gpu_used_outside_orchestrate_on_a_host_is_avoided_and_named(ssh_cli: SshCli) -> None:
    wrapper = gpu_python(ssh_cli)
    ssh_cli.inventory([gpu_node(ssh_cli)], python=wrapper)
    notebook = _on_h1(ssh_cli, "sleep 300")
    try:
        set_compute_apps(Path(wrapper).parent, [(notebook, "python3", 0, 30720)])
        job = ssh_cli.write("one.yaml", """
            name: one
            backend: ssh
            inventory: inv.yaml
            resources: {nodes: 1, gpus_per_node: 1, gpu_model: A100-80GB}
            distributed: {backend: gloo}
            command: [bash, -c, 'echo "gpus=$CUDA_VISIBLE_DEVICES"; sleep 60']
            """)
        ssh_cli.run("submit", str(job), "--detach", "--job-id", "one-1", check=True)
        ssh_cli.wait_running("one-1")
        plan = json.loads((ssh_cli.work / "runs" / "one-1" / "plan.json").read_text())
        assert plan["nodes"][0]["cuda_visible_devices"] == "1"  # not the notebook's GPU 0
        refused = ssh_cli.run("submit", str(job), "--detach", "--job-id", "one-2")
        assert refused.returncode == 75, refused.stderr
        assert f"GPU 0 in use by pid {notebook} (" in refused.stderr
        answer = json.loads(ssh_cli.run("gpus", "--json", "--inventory",
                                        str(ssh_cli.work / "inv.yaml"), check=True).stdout)
        [h1] = answer
        gpus = {g["index"]: g for g in h1["gpus"]}
        [process] = gpus[0]["holders"]
        assert process["kind"] == "process" and process["pid"] == notebook
        assert process["memory_gb"] == 30.0
        [lease] = gpus[1]["holders"]
        assert lease["kind"] == "job" and lease["job_id"] == "one-1"
        ssh_cli.run("cancel", "one-1", check=True)
        assert_nothing_left(ssh_cli, "one-1")
    finally:
        ssh_cli.hosts.run("h1", f"kill {notebook}")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["ends", "cancelled"])
def test_a_daemon_that_drops_the_job_tag_does_not_outlive_the_job_on_a_host(
        ssh_cli: SshCli, how: str) -> None:
    ssh_cli.inventory([{"name": "h1", "slots": 1, "lease_dir": str(ssh_cli.work / "book")}])
    marker = f"daemon-ssh-{how}-{time.time_ns()}"
    wait = "sleep 3" if how == "ends" else "sleep 600"
    job = ssh_cli.write("d.yaml", f"""
        name: d
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: 1, gpus_per_node: 1}}
        command: [bash, -c, '(setsid env -i bash -c "exec -a {marker} sleep 1000" &); {wait}']
        restart: {{max: 0}}
        """)
    job_id = f"d-{how}"
    ssh_cli.run("submit", str(job), "--detach", "--job-id", job_id, check=True)
    deadline = time.monotonic() + 30
    while not _named(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _named(marker), "the daemon never started on h1"
    if how == "cancelled":
        ssh_cli.run("cancel", job_id, check=True)
    final = ssh_cli.wait_state(job_id, {"COMPLETED", "CANCELLED", "FAILED"}, 30)
    assert final["state"] == ("COMPLETED" if how == "ends" else "CANCELLED"), final
    deadline = time.monotonic() + 10
    while _named(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _named(marker), f"the daemon {marker} outlived job {job_id} on h1"
    assert_nothing_left(ssh_cli, job_id)


def _named(marker: str) -> list[int]:
    """Processes (of any host: the root PID namespace sees them all) whose argv[0] is
    ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().split(b"\0")[0] == marker.encode():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.timeout(150)
def test_a_waiting_job_starts_on_the_host_when_its_gpus_free(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([gpu_node(ssh_cli)], python=gpu_python(ssh_cli))
    job = ssh_cli.write("pair.yaml", """
        name: pair
        backend: ssh
        inventory: inv.yaml
        resources: {nodes: 1, gpus_per_node: 2, gpu_model: A100-80GB}
        distributed: {backend: gloo}
        command: [bash, -c, 'echo "gpus=$CUDA_VISIBLE_DEVICES"; sleep 120']
        """)
    ssh_cli.run("submit", str(job), "--detach", "--job-id", "pair-1", check=True)
    ssh_cli.wait_running("pair-1")
    waiting = ssh_cli.run("submit", str(job), "--detach", "--job-id", "pair-2", "--wait")
    assert waiting.returncode == 0, waiting.stderr
    assert "job pair-2 is waiting" in waiting.stderr
    pending = ssh_cli.status("pair-2")
    assert pending["state"] == "PENDING" and "pair-1" in str(pending["reason"])
    ssh_cli.run("cancel", "pair-1", check=True)
    freed = time.monotonic()
    ssh_cli.wait_running("pair-2", timeout=30)
    assert time.monotonic() - freed < 15
    ssh_cli.run("cancel", "pair-2", check=True)
    assert_nothing_left(ssh_cli, "pair-2")
