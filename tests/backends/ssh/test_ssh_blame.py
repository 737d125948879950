"""The rank that explained a failure is the one named, over SSH too (issue #33 item 3): the
supervisor's rule is the local one, with the ranks' output coming back over channels."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.blamejob import PROGRAM
from tests.support.sshcli import SshCli

pytestmark = [pytest.mark.ssh, pytest.mark.torch]

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(300)
def test_a_nan_stop_explained_by_rank_0_on_h1_names_it_not_rank_1_on_h2(
        ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": "h1", "slots": 1}, {"name": "h2", "slots": 1}])
    ssh_cli.write("nanmodel.py", PROGRAM)
    job = ssh_cli.write("nanstop.yaml", f"""
        name: nanstop
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: 2, gpus_per_node: 1}}
        env: {{PYTHONPATH: "{REPO}"}}
        train:
          model: nanmodel:build_model
          dataset: nanmodel:build_dataset
          optimizer: {{name: sgd, lr: 0.1}}
          epochs: 1
          batch_size: 8
        """)
    job_id = "nanstop-" + os.urandom(3).hex()
    proc = ssh_cli.run("submit", str(job), "--follow", "--job-id", job_id, timeout=240)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    status = ssh_cli.status(job_id)
    failure = status["failure"]
    assert failure["rank"] == 0 and failure["node"] == "h1", failure
    assert any("the loss is not finite" in line for line in failure["last_lines"]), failure
    assert str(status["reason"]).startswith("rank 0 on h1"), status["reason"]
    assert "last lines of rank 0 (h1):" in proc.stderr
