"""The GPU health check in the SSH preflight (issue #35): h1 is the lab server with GPU 5 waiting
for a row remap (tests/hostside/gpuhealth/remap-pending, through the inventory's python wrapper:
the stand-in nvidia-smi and kernel log on its PATH). The agent gathers, the controller judges: a
job is planned around the sick GPU, one that needs every A6000 is refused naming it; a GPU that
goes bad between attempts is left out of the restart (its preflight, health included, runs
again)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.fakesmi import HEALTH_CASES
from tests.support.labserver import gpu_node, sick_gpu_python
from tests.support.sshcli import SshCli

pytestmark = pytest.mark.ssh


def _job(cli: SshCli, name: str, gpus: int) -> str:
    return str(cli.write(f"{name}.yaml", f"""
        name: {name}
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: 1, gpus_per_node: {gpus}, gpu_model: RTX-A6000}}
        distributed: {{backend: gloo}}
        command: [bash, -c, 'echo "gpus=$CUDA_VISIBLE_DEVICES"']
        """))


@pytest.mark.timeout(150)
def test_a_host_with_a_sick_gpu_is_planned_around_and_a_job_needing_it_refused(
        ssh_cli: SshCli) -> None:
    ssh_cli.inventory([gpu_node(ssh_cli)], python=sick_gpu_python(ssh_cli, "remap-pending"))
    done = ssh_cli.run("submit", _job(ssh_cli, "around", 5), "--job-id", "around-1", "--follow")
    assert done.returncode == 0, done.stderr
    assert "gpus=2,3,4,6,7" in done.stdout
    plan = json.loads((ssh_cli.work / "runs" / "around-1" / "plan.json").read_text())
    assert any("h1: left out GPU 5 (RTX A6000, 00000000:A1:00.0)" in n for n in plan["notes"])
    refused = ssh_cli.run("submit", _job(ssh_cli, "all", 6), "--job-id", "all-1")
    assert refused.returncode == 2, refused.stderr
    said = " ".join(refused.stderr.split())
    assert "5 usable GPU(s) (1 failed the health check), 6 requested" in said
    assert "GPU 5 (RTX A6000, 00000000:A1:00.0): 2 uncorrectable ECC errors" in said


@pytest.mark.timeout(150)
def test_a_gpu_that_goes_bad_between_attempts_is_left_out_of_the_restart(
        ssh_cli: SshCli) -> None:
    wrapper = sick_gpu_python(ssh_cli, "healthy")
    ssh_cli.inventory([gpu_node(ssh_cli)], python=wrapper)
    marker = ssh_cli.work / "went-bad"
    sick = HEALTH_CASES / "remap-pending" / "query.csv"
    query = Path(wrapper).parent / "nvsmi" / "query.csv"
    job = ssh_cli.write("bad.yaml", f"""
        name: bad
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: 1, gpus_per_node: 4, gpu_model: RTX-A6000}}
        restart: {{max: 1, on: [failure], backoff_s: [0]}}
        launcher: per_node
        distributed: {{backend: gloo}}
        command: [bash, -c, 'echo "gpus=$CUDA_VISIBLE_DEVICES"; test -e {marker} && exit 0;
                  touch {marker}; cp {sick} {query}; exit 1']
        """)
    done = ssh_cli.run("submit", str(job), "--job-id", "bad-1", "--follow")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpus=2,3,4,5" in done.stdout and "gpus=2,3,4,6" in done.stdout
    log = (ssh_cli.work / "runs" / "bad-1" / "supervisor.log").read_text()
    assert "GPU health on h1: GPU 5 (RTX A6000, 00000000:A1:00.0): 2 uncorrectable" in log
