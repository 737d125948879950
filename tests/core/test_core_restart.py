"""The restart decision every backend runs (orchestrate.core.plan.restart): the ending's kind, then
the policy's rules in order, then progress between attempts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrate.core.plan.outcome import Exit
from orchestrate.core.plan.restart import Policy, decide, ending_of, progress_marker, progressed

pytestmark = pytest.mark.unit

POLICY = Policy(max=2, on=("failure", "requeue", "stall"), backoff_s=(5.0, 30.0),
                exclude_failed_node=True)
ASKS = Exit(code=75)
TERM = Exit(signal=15)


def test_a_rank_asking_to_resume_and_others_stopped_after_it_is_a_requeue() -> None:
    # srun kills the step once one rank exits 75; a rank still exiting then dies by SIGTERM.
    ending = ending_of([ASKS, TERM], ASKS, "n2", "rank 1 on n2 ...")
    assert ending.kind == "requeue"
    assert ending_of([ASKS, ASKS], ASKS, None, "both asked").kind == "requeue"


def test_a_rank_that_crashed_beside_a_requeue_makes_it_a_failure() -> None:
    assert ending_of([ASKS, Exit(code=1)], ASKS, "n2", "r").kind == "failure"
    # A rank killed first (not asking) is no requeue even if the others then ask.
    assert ending_of([TERM, ASKS], TERM, "n1", "r").kind == "failure"
    assert ending_of([Exit(code=2)], Exit(code=2), "n1", "r").kind == "user_error"


def test_decide_restarts_in_budget_with_backoff_and_excludes_the_failed_node() -> None:
    failure = ending_of([Exit(code=1)], Exit(code=1), "n2", "rank 3 on n2 failed")
    first = decide(POLICY, failure, 0, True)
    assert (first.restart, first.wait_s, first.exclude) == (True, 5.0, ("n2",))
    assert first.why == "restart 1 of at most 2 in 5s, without n2"
    assert decide(POLICY, failure, 1, True).wait_s == 30.0
    spent = decide(POLICY, failure, 2, True)
    assert not spent.restart and "budget is spent (2 of restart.max = 2)" in spent.why


def test_decide_refuses_user_errors_unlisted_endings_and_attempts_without_progress() -> None:
    assert not decide(POLICY, ending_of([Exit(code=2)], Exit(code=2), None, "r"), 0, True).restart
    lost = ending_of([], None, "n1", "lost", lost=True)
    refused = decide(POLICY, lost, 0, True)
    assert not refused.restart and "restart.on does not include node_lost" in refused.why
    by_code = Policy(max=1, on=(137,), backoff_s=(), exclude_failed_node=False)
    assert decide(by_code, ending_of([Exit(code=137)], Exit(code=137), None, "r"), 0,
                  None).restart
    stuck = decide(POLICY, ending_of([ASKS], ASKS, None, "r"), 0, False)
    assert not stuck.restart and "made no progress" in stuck.why


def test_progress_is_a_newer_checkpoint_or_a_later_logged_step(tmp_path: Path) -> None:
    before = progress_marker(str(tmp_path), None)
    assert before == {"checkpoint_step": None, "step": None}
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step-00000020.pt").write_bytes(b"")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "step", "step": 23}) + "\n{")
    after = progress_marker(str(tmp_path), None)
    assert after == {"checkpoint_step": 20, "step": 23}
    assert progressed(before, after, True) is True
    assert progressed(after, after, True) is False
    # A command: job that writes neither: nothing can tell, only the budget bounds it.
    assert progressed(before, before, False) is None
