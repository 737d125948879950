"""A stuck Slurm job names the stuck rank and its node: the stall watch beside the step.

``monitor.py watch`` runs in the batch script while the step runs and reads the ranks'
heartbeats from the run directory every node shares; with ``on_stall: kill`` it cancels the
step and the batch script ends the run as a stall (``restart.on: [stall]`` would requeue it).
The ranks run tests/diagnosis/programs/steps.py, a plain Python program, one rank on each of two
nodes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support.output import merged_text
from tests.support.slurmcli import OrchestrateCli

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.timing]

STEPS = Path(__file__).resolve().parents[2] / "diagnosis" / "programs" / "steps.py"
STALL_S = 10


def _job(ocli: OrchestrateCli, name: str, scenario: str, extra_env: str = "",
         distributed: str = "on_stall: kill, timeout_s: 300") -> Path:
    marks = ocli.work / f"marks-{name}"
    marks.mkdir()
    return ocli.write(f"{name}.yaml", f"""
        name: {name}
        backend: slurm
        inventory: inventory.yaml
        resources: {{nodes: 2, gpus_per_node: 1, time: "00:05:00"}}
        distributed: {{backend: gloo, stall_s: {STALL_S}, {distributed}}}
        restart: {{max: 0}}
        env: {{SCENARIO: {scenario}, BAD_RANK: 1, TRIGGER_STEP: 8, MARKS: '{marks}'{extra_env}}}
        command: [python3, '{STEPS}']
        """)


def _gone(ocli: OrchestrateCli, external_id: str) -> None:
    """The step was cancelled: the job leaves the queue within seconds."""
    deadline = time.monotonic() + 30
    while ocli.cluster.run("squeue", "-h", "-j", external_id, check=False).stdout.strip():
        assert time.monotonic() < deadline, "the job still runs after the stall"
        time.sleep(0.5)


def test_a_laggard_is_named_with_its_node_and_the_step_stopped(ocli: OrchestrateCli) -> None:
    ocli.inventory()
    marks = ocli.work / "marks-lag"
    job_id = ocli.submit(_job(ocli, "lag", "laggard"))
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
    merged = merged_text(run_dir)
    assert "stalled: rank 1" in merged and "distributed.on_stall: kill" in merged
    _gone(ocli, str(status["external_id"]))


def test_mismatch_frozen_and_rendezvous_are_named_side_by_side(ocli: OrchestrateCli) -> None:
    """The rest of the matrix at once (the cluster has room for three 2-node jobs): the same
    watch beside each step, each kind from the evidence the nodes wrote."""
    ocli.inventory()
    jobs = {
        "mismatch": ocli.submit(_job(ocli, "mis", "mismatch")),
        "frozen": ocli.submit(_job(ocli, "frz", "frozen", ", SELF_STOP: '1'")),
        "rendezvous": ocli.submit(_job(ocli, "rdv", "rendezvous")),
    }
    for kind, job_id in jobs.items():
        status = ocli.wait(job_id, {"FAILED", "COMPLETED", "CANCELLED", "TIMEOUT"}, timeout=180)
        diagnosis = status["diagnosis"]
        assert status["state"] == "FAILED" and diagnosis is not None, (kind, status)
        assert diagnosis["kind"] == kind and diagnosis["ranks"] == [1], diagnosis
        host = next(r["host"] for r in status["ranks"] if r["rank"] == 1)
        assert diagnosis["nodes"] == [host], diagnosis
        assert f"stalled: rank 1 (node {host}" in status["reason"], status["reason"]
        _gone(ocli, str(status["external_id"]))
    mismatch = ocli.status(jobs["mismatch"])["diagnosis"]["summary"]
    assert " is in barrier #" in mismatch and "rank 0 is in all_reduce #" in mismatch
    frozen = ocli.status(jobs["frozen"])["diagnosis"]["summary"]
    assert "stopped answering" in frozen, frozen
    rendezvous = ocli.status(jobs["rendezvous"])["diagnosis"]["summary"]
    assert "never reached init_process_group" in rendezvous, rendezvous


def test_a_rank_hung_in_its_exit_is_named_with_its_node_and_the_step_stopped(
        ocli: OrchestrateCli) -> None:
    """Rank 1 ends its program and hangs in the interpreter's teardown; rank 0 exits 0. The
    batch host sees no process of the other node, but rank 0's task recorded its end: the
    watch names rank 1 alone, with its node. Under ``on_stall: report`` (the default), which
    no process-group timeout would end (the allocation held until its time limit), the step is
    stopped ``timeout_s`` + the slack (1 s here, the testing knob, which the batch job
    inherits) after the stall was named."""
    ocli.inventory()
    ocli.env["ORCHESTRATE_LINGER_SLACK_S"] = "1"
    job_id = ocli.submit(_job(ocli, "tdn", "teardown", ", STEPS: 12",
                              "on_stall: report, timeout_s: 10"))
    status = ocli.wait(job_id, {"FAILED", "COMPLETED", "CANCELLED", "TIMEOUT"}, timeout=180)
    began = float((ocli.work / "marks-tdn" / "trigger").read_text())
    diagnosis = status["diagnosis"]
    assert status["state"] == "FAILED" and diagnosis is not None, status
    assert (diagnosis["kind"], diagnosis["ranks"]) == ("teardown", [1]), diagnosis
    host = next(r["host"] for r in status["ranks"] if r["rank"] == 1)
    assert diagnosis["nodes"] == [host], diagnosis
    assert diagnosis["summary"].startswith(f"rank 1 (node {host}, pid "), diagnosis
    assert diagnosis["summary"].endswith("; rank 0 has exited"), diagnosis
    assert diagnosis["at"] - began < STALL_S + 30
    assert f"stalled: rank 1 (node {host}" in status["reason"], status["reason"]
    merged = merged_text(Path(status["run_dir"]))
    assert "(distributed.on_stall: report: they are stopped if still not exited 11s from now)" \
        in merged, merged[-3000:]
    assert "rank(s) [1] ended their programs but still had not exited " in merged, merged[-3000:]
    assert status["finished_at"] - diagnosis["at"] >= 11, (status["finished_at"], diagnosis)
    _gone(ocli, str(status["external_id"]))


def test_a_rank_computing_alone_is_not_a_stall(ocli: OrchestrateCli) -> None:
    """Issue #25 item 1 on Slurm (monitor.py's watch): rank 1 computes alone for 22 s while
    rank 0 waits in a barrier, ``stall_s`` 10, ``on_stall: kill``: the step is not cancelled,
    the job completes, and the merged log says why the stall was held off."""
    ocli.inventory()
    job_id = ocli.submit(_job(ocli, "solo", "solo", ", STEPS: 15, BUSY_S: 22"))
    status = ocli.wait(job_id, {"FAILED", "COMPLETED", "CANCELLED", "TIMEOUT"}, timeout=240)
    assert status["state"] == "COMPLETED" and status["diagnosis"] is None, status
    assert (ocli.work / "marks-solo" / "trigger").exists()
    host = next(r["host"] for r in status["ranks"] if r["rank"] == 1)
    merged = merged_text(Path(status["run_dir"]))
    notes = [line for line in merged.splitlines()
             if line.startswith("[orchestrate] no progress for")]
    assert len(notes) == 1, merged
    assert f"but not stalled: rank 1 (node {host}) computing at steps.py:" in notes[0], notes
