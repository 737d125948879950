"""FSDP on Slurm (issue #24): a ``strategy: fsdp`` job with one rank on each of two nodes of the
test cluster trains to COMPLETED, writes sharded checkpoints, and ``orchestrate export`` turns
them into a plain state dict that loads into the model. About 20 s once the cluster is up."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.clusters import BRING_UP
from tests.support.output import merged_text
from tests.support.sharded import DIGITS, FSDP_TRAIN, exported_loads, sharded_checkpoint
from tests.support.slurmcli import OrchestrateCli

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


@pytest.mark.timeout(BRING_UP + 180)
def test_fsdp_job_on_two_nodes_completes_checkpoints_and_exports(ocli: OrchestrateCli) -> None:
    ocli.inventory()
    job_id = ocli.submit(ocli.write("fsdp.yaml", f"""\
name: fsdp
inventory: inventory.yaml
backend: slurm
resources: {{nodes: 2, gpus_per_node: 1, time: "10"}}
workdir: {DIGITS}
distributed: {{timeout_s: 60}}
""" + FSDP_TRAIN))
    done = ocli.wait(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=150)
    run_dir = Path(done["run_dir"])
    text = merged_text(run_dir)
    assert done["state"] == "COMPLETED", text[-3000:]
    assert "strategy fsdp" in text
    sharded_checkpoint(run_dir)
    exported_loads(ocli.run, job_id, ocli.work / "fsdp.pt")
