"""Restarts on Slurm (issues 13, 37): a rank killed with SIGKILL mid-training; the batch job
decides (monitor.py, the same policy as every backend) and, the allocation being intact, runs the
ranks again as a new step of the same Slurm job (no requeue, no queue); the second run resumes
from the checkpoint and ends where an uninterrupted run ends, parameter for parameter; the
attempts and their reasons are kept in the run directory."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.checkpoints import differing_parameters, latest_state
from tests.support.clusters import BRING_UP
from tests.support.output import merged_text
from tests.support.slurmcli import TRAIN_JOB, OrchestrateCli

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

REPO = Path(__file__).resolve().parents[3]

RESTARTING = TRAIN_JOB.replace("restart: {{max: 2}}",
                               "restart: {{max: 1, on: [failure], backoff_s: [0]}}")


def _rank_pid(job_id: str, rank: int) -> int:
    """The trainer process of ``rank`` of our job, found by its tag as kill-by-tag finds it
    (the test cluster's nodes share this machine's process table)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            command = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if (f"ORCHESTRATE_JOB_ID={job_id}".encode() in environ
                and f"RANK={rank}".encode() in environ and b"orchestrate.train" in command):
            return int(entry)
    raise LookupError(f"no trainer process of rank {rank} of {job_id}")


@pytest.mark.timeout(BRING_UP + 360)
def test_a_killed_rank_restarts_as_a_new_step_and_ends_where_an_uninterrupted_run_ends(
    ocli: OrchestrateCli,
) -> None:
    ocli.inventory()
    digits = REPO / "examples" / "digits"
    assert "restart: {{max: 1, on: [failure]" in RESTARTING
    straight_id = ocli.submit(ocli.write("straight.yaml",
                                         RESTARTING.format(name="straight", workdir=digits)))
    killed_id = ocli.submit(ocli.write("killed.yaml",
                                       RESTARTING.format(name="killed", workdir=digits)))
    status = ocli.wait(killed_id, {"RUNNING"}, timeout=60)
    run = Path(status["run_dir"])
    deadline = time.monotonic() + 90
    while "epoch 1/6" not in merged_text(run):
        assert time.monotonic() < deadline, merged_text(run) or "no log"
        time.sleep(0.1)
    os.kill(_rank_pid(killed_id, 1), signal.SIGKILL)

    done = ocli.wait(killed_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    text = merged_text(run)
    assert done["state"] == "COMPLETED", text[-3000:]
    attempts = done["attempts"]
    assert [a["n"] for a in attempts] == [1, 2], attempts
    assert "failed with signal 9 (SIGKILL)" in attempts[0]["reason"], attempts
    assert "restarting in the allocation, restart 1 of at most 1" in attempts[0]["reason"]
    # The same Slurm job, never requeued: run 1 ended RESTARTED and run 2 started in it.
    events = [json.loads(line) for line in
              (run / "slurm" / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["restart"], e.get("outcome")) for e in events] == [
        ("start", 0, None), ("end", 0, "RESTARTED"), ("start", 1, None),
        ("end", 1, "COMPLETED")], events
    assert {e["slurm_job_id"] for e in events} == {int(done["external_id"])}, events
    assert "resuming from" in text
    reference = ocli.wait(straight_id, {"COMPLETED", "FAILED"}, timeout=180)
    assert reference["state"] == "COMPLETED"
    a = latest_state(Path(reference["run_dir"]))
    b = latest_state(Path(done["run_dir"]))
    assert a["step"] == b["step"] > 0
    assert differing_parameters(a, b) == []
