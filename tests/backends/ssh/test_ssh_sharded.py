"""FSDP over SSH (issue #24): a ``strategy: fsdp`` job with one rank on each of two test hosts
trains to COMPLETED, writes sharded checkpoints, and ``orchestrate export`` turns them into a
plain state dict that loads into the model. About 15 s."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.output import merged_text
from tests.support.sharded import DIGITS, FSDP_TRAIN, REPO, exported_loads, sharded_checkpoint
from tests.support.sshcli import SshCli
from tests.support.sshhosts import tagged_on

pytestmark = [pytest.mark.ssh, pytest.mark.torch]


@pytest.mark.timeout(180)
def test_fsdp_job_on_two_hosts_completes_checkpoints_and_exports(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": "h1", "slots": 1}, {"name": "h2", "slots": 1}])
    job = "fsdp-" + os.urandom(3).hex()
    path = ssh_cli.write("fsdp.yaml", f"""\
name: fsdp
backend: ssh
inventory: inv.yaml
resources: {{nodes: 2, gpus_per_node: 1}}
workdir: {DIGITS}
env: {{PYTHONPATH: "{REPO}"}}
""" + FSDP_TRAIN)
    ssh_cli.run("submit", str(path), "--detach", "--job-id", job, check=True, timeout=120)
    done = ssh_cli.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 150)
    assert done["state"] == "COMPLETED", done
    assert sorted(r["host"] for r in done["ranks"]) == ["h1", "h2"], done["ranks"]
    run_dir = Path(done["run_dir"])
    assert "strategy fsdp" in merged_text(run_dir)
    sharded_checkpoint(run_dir)
    exported_loads(ssh_cli.run, job, ssh_cli.work / "fsdp.pt")
    assert not any(tagged_on(ssh_cli.hosts, job, ["h1", "h2"]).values())  # nothing left
