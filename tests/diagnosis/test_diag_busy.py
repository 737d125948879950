"""Healthy jobs that are busy without progress are not stalls; busy past ``busy_s``, they are.

Issue #25 item 1: with ``stall_s: 10``, two gloo ranks of a plain program
(tests/diagnosis/programs/steps.py) that compute for 22 s in one step with no collective, or
whose rank 1 computes alone while rank 0 waits in a barrier, or whose rank 1 reads slow
storage (programs/slowstore.py: its main thread sleeps in read(2) on a file) were named as
stalls. The driver plays the launcher (tests/support/diagranks.drive), as in
test_diag_stalls.py, and also keeps the notice the watch gives when busy ranks hold a stall off.
"""

from __future__ import annotations

import pytest

from orchestrate.diagnosis import evidence
from tests.support.diagranks import Starter, drive

pytestmark = [pytest.mark.process, pytest.mark.torch, pytest.mark.timing]

STALL_S = 10.0
HEARTBEAT_S = 0.5
BUSY_S = 22.0  # how long the ranks are busy: more than twice the stall bound
NODES = {0: "node-a", 1: "node-b"}


def _busy_job(starter: Starter, scenario: str, busy_s: float) -> tuple:  # type: ignore[type-arg]
    job = starter.program(scenario, world=2, heartbeat_s=HEARTBEAT_S,
                          env={"BAD_RANK": "1", "TRIGGER_STEP": "5", "STEPS": "15",
                               "BUSY_S": str(busy_s)})
    holds: list[str] = []
    outcome = drive(job, stall_s=STALL_S, heartbeat_s=HEARTBEAT_S, deadline_s=180, nodes=NODES,
                    holds=holds)
    return job, outcome, holds


def _completed(job, outcome) -> None:  # type: ignore[no-untyped-def]
    assert outcome.diagnosis is None, outcome.diagnosis.summary
    assert job.wait(60) == {0: 0, 1: 0}, job.output()
    beats = evidence.read_heartbeats(job.run_dir, job.ranks)
    assert {r: b.phase for r, b in beats.items() if b} == {0: "exit", 1: "exit"}


def test_every_rank_in_one_long_cpu_step_is_computing_not_stalled(starter: Starter) -> None:
    job, outcome, holds = _busy_job(starter, "compute", BUSY_S)
    _completed(job, outcome)
    assert (job.marks / "trigger-0").exists() and (job.marks / "trigger-1").exists()
    assert len(holds) == 1, holds
    assert holds[0].startswith("no progress for 1"), holds
    assert "but not stalled: rank 0 (node node-a) computing at steps.py:" in holds[0], holds
    assert "rank 1 (node node-b) computing at steps.py:" in holds[0], holds
    assert holds[0].endswith("(a stall only after distributed.busy_s, 1800 s without "
                             "progress)"), holds


def test_a_rank_computing_alone_while_the_other_waits_is_not_stalled(starter: Starter) -> None:
    """A ``command:`` rank's own CPU time is activity, as the trainer's is."""
    job, outcome, holds = _busy_job(starter, "solo", BUSY_S)
    _completed(job, outcome)
    assert len(holds) == 1 and "rank 1 (node node-b) computing at steps.py:" in holds[0], holds
    assert "rank 0" not in holds[0], holds  # it waits in the barrier: not busy


def test_slow_io_is_said_and_not_a_stall_before_busy_s(starter: Starter) -> None:
    job, outcome, holds = _busy_job(starter, "slowio", BUSY_S)
    _completed(job, outcome)
    assert len(holds) == 1, holds
    assert "rank 1 (node node-b) in slow I/O at slowstore.py:" in holds[0], holds
    assert f"(read of {job.marks}/slow-" in holds[0] and ".fifo" in holds[0], holds


def test_slow_io_past_busy_s_is_a_stall_that_names_the_slow_read(starter: Starter) -> None:
    busy_bound = 20.0
    job = starter.program("slowio", world=2, heartbeat_s=HEARTBEAT_S,
                          env={"BAD_RANK": "1", "TRIGGER_STEP": "5", "BUSY_S": "-1"})
    outcome = drive(job, stall_s=STALL_S, heartbeat_s=HEARTBEAT_S, deadline_s=180, nodes=NODES,
                    busy_s=busy_bound)
    trigger = job.wait_mark("trigger")
    diagnosis = outcome.diagnosis
    assert diagnosis is not None, job.output()
    assert outcome.stall is not None and outcome.stall.reason == "busy", outcome.stall
    assert outcome.stall.busy == {1: "in slow I/O"}
    assert diagnosis.kind == "laggard" and diagnosis.ranks == (1,), diagnosis.summary
    assert diagnosis.summary.startswith(
        "rank 1 (node node-b) has not reached collective #7: it is in slowstore.py:"), (
        diagnosis.summary)
    assert f"`slow_read` (slow I/O: read of {job.marks}/slow-" in diagnosis.summary
    assert "; rank 0 waits in all_reduce #7 for " in diagnosis.summary
    assert outcome.at is not None
    assert busy_bound * 0.9 <= outcome.at - trigger <= busy_bound + 30
