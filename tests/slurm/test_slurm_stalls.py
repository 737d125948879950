"""A stuck Slurm job names the stuck rank and its node: the stall watch beside the step.

``monitor.py watch`` runs in the batch script while the step runs and reads the ranks'
heartbeats from the run directory every node shares; with ``on_stall: kill`` it cancels the
step and the batch script ends the run as a stall (``restart.on: [stall]`` would requeue it).
The ranks run tests/diag/programs/steps.py, a plain Python program, one rank on each of two
nodes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.slurm.conftest import OrchestrateCli

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

STEPS = Path(__file__).resolve().parents[1] / "diag" / "programs" / "steps.py"
STALL_S = 10


def test_a_laggard_is_named_with_its_node_and_the_step_stopped(ocli: OrchestrateCli) -> None:
    ocli.inventory()
    marks = ocli.work / "marks"
    marks.mkdir()
    job = ocli.write("lag.yaml", f"""
        name: lag
        backend: slurm
        inventory: inventory.yaml
        resources: {{nodes: 2, gpus_per_node: 1, time: "00:05:00"}}
        distributed: {{backend: gloo, stall_s: {STALL_S}, on_stall: kill, timeout_s: 300}}
        restart: {{max: 0}}
        env: {{SCENARIO: laggard, BAD_RANK: 1, TRIGGER_STEP: 8, MARKS: '{marks}'}}
        command: [python3, '{STEPS}']
        """)
    job_id = ocli.submit(job)
    status = ocli.wait(job_id, {"FAILED", "COMPLETED", "CANCELLED", "TIMEOUT"}, timeout=180)
    began = float((marks / "trigger").read_text())
    diagnosis = status["diagnosis"]
    assert status["state"] == "FAILED" and diagnosis is not None, status
    assert diagnosis["kind"] == "laggard" and diagnosis["ranks"] == [1], diagnosis
    host = next(r["host"] for r in status["ranks"] if r["rank"] == 1)
    assert diagnosis["nodes"] == [host]
    assert diagnosis["summary"].startswith(f"rank 1 (node {host}) has not reached collective")
    assert diagnosis["at"] - began < STALL_S + 30
    assert "stalled: rank 1" in status["reason"], status["reason"]
    run_dir = Path(status["run_dir"])
    assert json.loads((run_dir / "diag" / "diagnosis.json").read_text())["kind"] == "laggard"
    merged = (run_dir / "output.log").read_text()
    assert "stalled: rank 1" in merged and "distributed.on_stall: kill" in merged
    # The step was cancelled: no rank still runs.
    deadline = time.monotonic() + 30
    while ocli.cluster.run("squeue", "-h", "-j", str(status["external_id"]),
                           check=False).stdout.strip():
        assert time.monotonic() < deadline, "the job still runs after the stall"
        time.sleep(0.5)
