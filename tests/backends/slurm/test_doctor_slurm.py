"""`orchestrate doctor` on the real Slurm test cluster: the checkup runs as a Slurm job through
sbatch and srun like the job would, its ranks name the nodes Slurm gave them, and every tier
passes on two healthy nodes (each in its own network namespace in the netns layout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.clusters import BRING_UP
from tests.support.slurmcli import OrchestrateCli

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(BRING_UP + 180)
def test_every_tier_passes_on_two_slurm_nodes(ocli: OrchestrateCli) -> None:
    ocli.inventory()
    job = ocli.write("doc.yaml", f"""\
        name: doc
        inventory: inventory.yaml
        backend: slurm
        resources: {{nodes: 2, gpus_per_node: 1}}
        command: [python, -c, "print('the job ran')"]
        env: {{PYTHONPATH: "{REPO}"}}
        """)
    proc = ocli.run("doctor", str(job), "--json", "--sizes", "256K", "--pair-size", "2M",
                    "--budget-s", "0.2", "--timeout-s", "15", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["verdict"] == "pass", [c for c in doc["checks"] if c["status"] != "pass"]
    nodes = doc["doctor"]["nodes"]
    assert len(nodes) == 2 and set(nodes) <= set(ocli.cluster.nodes)  # where Slurm put it
    assert {c["tier"] for c in doc["checks"]} == {"static", "connect", "smoke", "bandwidth"}
    interface = "eth0" if ocli.cluster.layout == "netns" else "lo"
    rows = [c for c in doc["checks"] if c["name"] == "interface"]
    assert sorted(n for c in rows for n in c["nodes"]) == sorted(nodes)
    assert all(c["detail"].startswith(f"{interface} is up") for c in rows), rows
    connect = {c["name"]: c for c in doc["checks"] if c["tier"] == "connect"}
    assert sorted(connect["master port"]["nodes"]) == sorted(nodes)
    assert "2 of 2 node-to-node connection(s)" in connect["node-to-node ports"]["detail"]
    assert doc["bandwidth"]["pairs"]["nodes"] == nodes
    run_dir = Path(doc["doctor"]["run_dir"])
    assert (run_dir / "doctor.html").exists()
    status = ocli.status(doc["doctor"]["job_id"])
    assert status["state"] == "COMPLETED" and status["external_id"]
