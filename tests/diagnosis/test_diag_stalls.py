"""Real stalls of real gloo ranks, found and named by the sidecar + StallWatch + classify.

Each test starts 3 ranks of a plain Python program (tests/diagnosis/programs/steps.py: no
orchestrate import; the sidecar arrives as sitecustomize), makes one rank misbehave, and plays the
launcher
(tests/support/diagranks.drive). What a user would check: the kind, the rank, that the one
sentence names it, and that it came within ``stall_s + 30`` s of the trouble.
"""

from __future__ import annotations

import json

import pytest

from orchestrate.diagnosis import evidence
from tests.support.diagranks import PROGRAMS, Starter, drive

pytestmark = [pytest.mark.process, pytest.mark.torch, pytest.mark.timing]

STALL_S = 12.0
HEARTBEAT_S = 0.3
NODES = {0: "node-a", 1: "node-a", 2: "node-b"}


def line_of(text: str) -> int:
    """The line of programs/steps.py that holds ``text`` (what a stack names)."""
    lines = (PROGRAMS / "steps.py").read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if text in line)


def _diagnosed(job, name: str) -> tuple:  # type: ignore[no-untyped-def, type-arg]
    outcome = drive(
        job, stall_s=STALL_S, heartbeat_s=HEARTBEAT_S, deadline_s=150, nodes=NODES,
        capture=name,
    )
    assert outcome.diagnosis is not None, f"no stall found\n{job.output()}"
    return outcome, outcome.diagnosis


def test_mismatch_names_the_rank_with_the_extra_collective(starter: Starter) -> None:
    job = starter.program("mismatch", env={"BAD_RANK": "2", "TRIGGER_STEP": "15"})
    outcome, diagnosis = _diagnosed(job, "mismatch")
    trigger = job.wait_mark("trigger")
    assert diagnosis.kind == "mismatch", diagnosis.summary
    assert diagnosis.ranks == (2,)
    assert diagnosis.nodes == ("node-b",)
    # steps 0..14 are all_reduce #1..#15; the extra barrier at step 15 is #16
    assert diagnosis.summary == (
        f"rank 2 (node node-b) is in barrier #16 at steps.py:{line_of('an extra collective')}; "
        "ranks 0-1 are in all_reduce #16"
    )
    assert outcome.at - trigger <= STALL_S + 30
    assert outcome.at - trigger >= STALL_S * 0.8  # the rule waited for the bound
    # what status --json will show
    saved = evidence.read_diagnosis(job.run_dir)
    assert saved is not None and saved.kind == "mismatch" and saved.ranks == (2,)
    assert any(f.endswith("rank-2.stacks.txt") for f in saved.files)


def test_laggard_names_the_rank_stuck_in_its_data_loading(starter: Starter) -> None:
    job = starter.program("laggard", env={"BAD_RANK": "1", "TRIGGER_STEP": "15"})
    outcome, diagnosis = _diagnosed(job, "laggard")
    trigger = job.wait_mark("trigger")
    assert diagnosis.kind == "laggard", diagnosis.summary
    assert diagnosis.ranks == (1,)
    assert diagnosis.summary.startswith(
        "rank 1 (node node-a) has not reached collective #15: it is in "
        f"steps.py:{line_of('the stuck read')} `__next__` (sleeping"
    ), diagnosis.summary
    assert "; ranks 0,2 wait in all_reduce #15 for " in diagnosis.summary
    assert outcome.at - trigger <= STALL_S + 30


def test_frozen_rank_is_named_by_its_silence(starter: Starter) -> None:
    job = starter.program("frozen", env={"BAD_RANK": "2", "TRIGGER_STEP": "15"})
    job.wait_mark("ready")
    job.stop(2)
    pid = job.procs[2].pid
    outcome, diagnosis = _diagnosed(job, "frozen")
    assert diagnosis.kind == "frozen", diagnosis.summary
    assert diagnosis.ranks == (2,)
    assert diagnosis.summary.startswith(f"rank 2 (node node-b, pid {pid}) stopped answering ")
    assert diagnosis.summary.endswith(" s ago (process stopped or hung in native code)")
    assert outcome.stall is not None and outcome.stall.reason == "silent"
    assert outcome.observed_s <= STALL_S + 30


def test_rendezvous_names_the_rank_that_never_joined(starter: Starter) -> None:
    job = starter.program("rendezvous", env={"BAD_RANK": "1"})
    outcome, diagnosis = _diagnosed(job, "rendezvous")
    trigger = job.wait_mark("trigger")
    assert diagnosis.kind == "rendezvous", diagnosis.summary
    assert diagnosis.ranks == (1,)
    assert diagnosis.summary.startswith(
        "rank 1 (node node-a) never reached init_process_group (rank 1 is in "
        f"steps.py:{line_of('time.sleep(3600)  # never joins')} `prepare`, sleeping"
    ), diagnosis.summary
    assert diagnosis.summary.endswith(f"; ranks 0,2 wait at {job.master}")
    assert outcome.at - trigger <= STALL_S + 30


def test_healthy_job_with_a_long_rank0_pause_is_not_flagged(starter: Starter) -> None:
    job = starter.program(
        "healthy",
        env={"TRIGGER_STEP": "10", "STEPS": "40", "PAUSE_S": str(STALL_S * 0.6)},
    )
    outcome = drive(job, stall_s=STALL_S, heartbeat_s=HEARTBEAT_S, deadline_s=150, nodes=NODES)
    assert outcome.diagnosis is None, outcome.diagnosis
    assert job.wait(30) == {0: 0, 1: 0, 2: 0}, job.output()
    assert (job.marks / "pause").exists()
    # every rank said goodbye
    beats = evidence.read_heartbeats(job.run_dir, job.ranks)
    assert {r: b.phase for r, b in beats.items() if b} == {0: "exit", 1: "exit", 2: "exit"}
    assert all(b and b.pgs and b.pgs[0].completed >= 41 for b in beats.values()), (
        json.dumps({r: b and b.to_json() for r, b in beats.items()})[:2000]
    )
