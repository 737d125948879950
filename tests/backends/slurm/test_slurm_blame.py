"""The rank that explained a failure is the one named on Slurm too (issue #33 item 3): the
batch job's monitor and ``status`` read the ranks' last lines with the rule every backend uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.blamejob import PROGRAM
from tests.support.clusters import BRING_UP
from tests.support.slurmcli import OrchestrateCli

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(BRING_UP + 240)
def test_a_nan_stop_explained_by_rank_0_names_rank_0(ocli: OrchestrateCli) -> None:
    ocli.inventory()
    ocli.write("nanmodel.py", PROGRAM)
    job = ocli.write("nanstop.yaml", f"""\
        name: nanstop
        inventory: inventory.yaml
        backend: slurm
        resources: {{nodes: 2, gpus_per_node: 1, time: "10"}}
        workdir: {ocli.work}
        env: {{PYTHONPATH: "{REPO}"}}
        train:
          model: nanmodel:build_model
          dataset: nanmodel:build_dataset
          optimizer: {{name: sgd, lr: 0.1}}
          epochs: 1
          batch_size: 8
        """)
    job_id = ocli.submit(job)
    status = ocli.wait(job_id, {"FAILED", "COMPLETED", "CANCELLED"}, timeout=180)
    assert status["state"] == "FAILED", status
    failure = status["failure"]
    assert failure["rank"] == 0, failure
    assert any("the loss is not finite" in line for line in failure["last_lines"]), failure
    assert str(status["reason"]).startswith("rank 0 on "), status["reason"]
