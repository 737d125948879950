"""Lightning Fabric, the Lightning Trainer and accelerate on the real Slurm test cluster: 2x2,
2x2 on nodes named in the reverse of Slurm's order, and 3+2 (the issue's table, row by row).

Slurm numbers a job's nodes in its own (sorted) order and the batch script unsets the per-node
task count for an uneven step; Lightning's SLURMEnvironment reads both. Each rank's probe line
must show the plan's numbers in what the framework believes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.clusters import BRING_UP
from tests.support.frameworkprobes import assert_believes_plan, copy_probes, job_text
from tests.support.slurmcli import OrchestrateCli

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.frameworks]

RUN = 300  # 4-5 ranks importing torch and Lightning on a small shared machine

#: (node slots of the inventory, resources of the job): the rows of the issue's table.
LAYOUTS: dict[str, tuple[dict[str, int], str]] = {
    "2x2": ({}, '{nodes: 2, gpus_per_node: 2, time: "5"}'),
    "reversed": ({}, '{nodes: 2, gpus_per_node: 2, node_names: [n2, n1], time: "5"}'),
    "uneven": ({"n1": 2, "n2": 3, "n3": 3},
               '{nodes: 2, gpus_per_node: all, node_names: [n3, n1], time: "5"}'),
}
CASES = [(layout, probe) for layout in ("2x2", "reversed") for probe in
         ("fabric", "trainer", "accelerate")] + [("uneven", "fabric"), ("uneven", "accelerate")]


def _plan(ocli: OrchestrateCli, job: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(ocli.run("plan", str(job), "--json", check=True).stdout)
    return result


@pytest.mark.parametrize(("layout", "probe"), CASES, ids=["-".join(case) for case in CASES])
@pytest.mark.timeout(BRING_UP + RUN)
def test_framework_believes_the_plan_on_slurm(ocli: OrchestrateCli, layout: str,
                                              probe: str) -> None:
    slots, resources = LAYOUTS[layout]
    ocli.inventory(slots=slots)
    copy_probes(ocli.work)
    job = ocli.write("probe.yaml", job_text(probe, f"{probe}-{layout}", "slurm", resources,
                                            inventory="inventory.yaml"))
    plan = _plan(ocli, job)
    if layout == "reversed":
        assert [n["name"] for n in plan["nodes"]] == ["n2", "n1"]
    if layout == "uneven":
        assert [(n["name"], n["nproc"]) for n in plan["nodes"]] == [("n3", 3), ("n1", 2)]
    proc = ocli.run("submit", str(job), "--follow", timeout=RUN - 20)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr
    records = assert_believes_plan(proc.stdout, plan, probe, "SLURMEnvironment",
                                   launcher="--task")
    # What Lightning's SLURMEnvironment reads is the plan's, whatever order Slurm has the
    # nodes in; accelerate never looks at it, but the step shows it the same.
    nodes = {n["name"]: n for n in plan["nodes"]}
    for entry in plan["ranks"]:
        env = records[entry["rank"]]["env"]
        assert env["TORCHELASTIC_RUN_ID"] is None
        assert (env["SLURM_PROCID"], env["SLURM_LOCALID"], env["SLURM_NODEID"]) == (
            str(entry["rank"]), str(entry["local_rank"]), str(entry["node_rank"]))
        assert env["SLURM_NTASKS_PER_NODE"] == str(nodes[entry["node"]]["nproc"])
        assert (env["SLURM_NTASKS"], env["SLURM_NNODES"]) == (
            str(plan["world_size"]), str(len(plan["nodes"])))


@pytest.mark.timeout(BRING_UP + 60)
def test_trainer_on_uneven_slurm_nodes_is_refused_before_sbatch(ocli: OrchestrateCli) -> None:
    slots, resources = LAYOUTS["uneven"]
    ocli.inventory(slots=slots)
    job = ocli.write("trainer.yaml", job_text("trainer", "trainer-uneven", "slurm", resources,
                                              inventory="inventory.yaml"))
    proc = ocli.run("submit", str(job), "--detach")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert ("framework: the Lightning Trainer cannot run nodes with different rank counts "
            "(n3: 3, n1: 2)") in proc.stderr
    assert "hint: give every node the same count" in proc.stderr
    queued = ocli.cluster.run("squeue", "-h", "-o", "%o").stdout
    assert str(ocli.work) not in queued
    assert not (ocli.work / "runs").exists() or not any((ocli.work / "runs").iterdir())
