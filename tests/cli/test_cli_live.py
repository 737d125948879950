"""The live view of ``status --watch`` for a job without timing figures (a ``command:`` job) and
for a stuck one: the job's reason and the stall, what each rank does, and how long since each
last progressed (a stuck rank's sidecar still beats; that age must not say "0s ago")."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from orchestrate.cli.live import Snapshot, activity, progress_time, render, why_lines
from orchestrate.diagnosis.diagfiles import GroupState, Heartbeat, InFlight
from orchestrate.report.straggler import Pace

pytestmark = pytest.mark.unit

NO_PACE = Pace(ranks=(), straggler=None, slowest=None)


def _text(snap: Snapshot) -> str:
    console = Console(width=150, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render(snap))
    return console.export_text()


def test_a_stuck_ranks_progress_age_grows_while_its_sidecar_beats() -> None:
    stuck = Heartbeat(rank=1, t=200.0, phase="step", step=8, progress_t=150.0)
    assert progress_time(stuck) == 150.0
    assert progress_time(Heartbeat(rank=0, t=199.0)) == 199.0
    assert progress_time(None) is None


def test_activity_names_phase_step_and_collective_counts() -> None:
    waiting = Heartbeat(rank=0, phase="step", step=8, pgs=(
        GroupState("0", enqueued=9, completed=8, in_flight=InFlight(9, "all_reduce")),))
    assert activity(waiting) == "step 8 · group 0: all_reduce #9 waiting"
    assert activity(Heartbeat(rank=0, phase="validate", step=3)) == "validate, step 3"
    running = Heartbeat(rank=1, phase="start", pgs=(GroupState("0", enqueued=3, completed=3),
                                                    GroupState("1", enqueued=1, completed=1)))
    assert activity(running) == ("start · group 0: 3 collectives done · "
                                 "group 1: 1 collectives done")
    assert activity(None) == ""


def test_a_command_job_shows_what_each_rank_does_and_the_stall() -> None:
    summary = "rank 1 (node localhost) has not progressed for 12 s; rank 0 is in all_reduce #9"
    status = {"id": "j-1", "state": "RUNNING", "started_at": 50.0,
              "reason": f"stalled: {summary}",
              "diagnosis": {"kind": "laggard", "summary": summary},
              "ranks": [{"rank": 0, "node": "localhost", "state": "RUNNING"},
                        {"rank": 1, "node": "localhost", "state": "RUNNING"}]}
    text = _text(Snapshot(status=status, pace=NO_PACE, now=200.0,
                          heartbeats={0: 198.0, 1: 150.0},
                          activity={0: "step 8 · group 0: all_reduce #9 waiting",
                                    1: "step 8 · group 0: 8 collectives done"}))
    assert f"stalled: {summary}" in text
    assert text.count(summary) == 1, "the diagnosis the reason says is not said twice"
    assert re.search(r"^\s*0 +localhost +RUNNING +step 8 · group 0: all_reduce #9 waiting +2s ago",
                     text, flags=re.M), text
    assert re.search(r"^\s*1 +localhost .* 50s ago", text, flags=re.M), text
    assert "waiting for the first steps" not in text


def test_a_diagnosis_the_reason_does_not_say_is_shown() -> None:
    status = {"reason": "rank 1 failed",
              "diagnosis": {"kind": "frozen", "summary": "rank 1 stopped answering"}}
    assert why_lines(status) == ["rank 1 failed", "stalled (frozen): rank 1 stopped answering"]
    assert why_lines({"reason": None, "diagnosis": None}) == []


def test_before_any_heartbeat_the_view_waits_for_the_first_steps() -> None:
    status = {"id": "j-2", "state": "RUNNING", "ranks": [{"rank": 0, "node": "a",
                                                          "state": "RUNNING"}]}
    assert "waiting for the first steps..." in _text(Snapshot(status=status, pace=NO_PACE))
