"""Lightning Fabric, the Lightning Trainer and accelerate on the local backend: 2 ranks, real
processes, real gloo, the real frameworks from the test extra."""

from __future__ import annotations

import json

import pytest

from tests.support.frameworkprobes import PROBES, assert_believes_plan, copy_probes, job_text
from tests.support.localcli import Cli

pytestmark = [pytest.mark.process, pytest.mark.torch, pytest.mark.frameworks]


@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.timeout(300)
def test_two_local_ranks_believe_the_plan(cli: Cli, probe: str) -> None:
    copy_probes(cli.work)
    job = cli.write("probe.yaml", job_text(probe, probe, "local", "{nodes: 1, gpus_per_node: 2}"))
    job_id = cli.id(probe)
    plan = json.loads(cli.run("plan", str(job), "--json", "--job-id", job_id, check=True).stdout)
    proc = cli.run("submit", str(job), "--follow", "--job-id", job_id, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr
    records = assert_believes_plan(proc.stdout, plan, probe, "TorchElasticEnvironment",
                                   launcher="orchestrate.backends.", on_hosts=False)
    # Lightning read the torchrun variables because of this, and nothing Slurm-like leaked in.
    assert {r["env"]["TORCHELASTIC_RUN_ID"] for r in records.values()} == {job_id}
    if probe == "fabric":
        # Fabric no longer probes for Slurm (and so warns about an unused srun on PATH); the
        # Trainer still does, from its checkpoint connector, whatever the environment.
        assert "srun` command is available" not in proc.stdout
