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


# ---- the policy a job file writes (orchestrate.core.spec.restartspec.RestartPolicy) --------------


def _policy(restart: dict[str, object] | None) -> Policy:
    from orchestrate.core.spec.job import JobSpec

    data: dict[str, object] = {"name": "j", "command": ["python", "t.py"]}
    if restart is not None:
        data["restart"] = restart
    spec = JobSpec.model_validate(data).restart
    return Policy(max=spec.max, on=tuple(spec.on), backoff_s=tuple(spec.backoff_s),
                  exclude_failed_node=spec.exclude_failed_node)


def test_a_restart_budget_alone_covers_failures_as_torchruns_does() -> None:
    """``restart: {max: 3}`` restarts a crashed rank (torchrun's --max-restarts restarts on any
    worker failure); it used to mean only requeue and node_lost, so it never did."""
    written = _policy({"max": 3})
    assert written.on == ("requeue", "node_lost", "failure")
    crash = ending_of([Exit(signal=9)], Exit(signal=9), "n1", "rank 0 on n1 was killed")
    assert decide(written, crash, 0, True).restart
    assert _policy({"max": 2, "backoff_s": [0]}).on == ("requeue", "node_lost", "failure")


def test_restart_on_given_is_honoured_exactly_and_nothing_written_keeps_the_default() -> None:
    assert _policy({"max": 3, "on": ["requeue"]}).on == ("requeue",)
    assert _policy({"on": ["stall"]}).on == ("stall",)
    assert _policy(None).on == ("requeue", "node_lost")
    assert _policy({"backoff_s": [5]}).on == ("requeue", "node_lost")
    # max: 0 is no restart at all, whatever the endings.
    zero = _policy({"max": 0})
    crash = ending_of([Exit(code=1)], Exit(code=1), None, "r")
    assert not decide(zero, crash, 0, True).restart


def test_plan_says_what_the_policy_will_and_will_not_restart(tmp_path: Path) -> None:
    from tests.support.corecli import CORE, cli

    job = CORE / "jobs" / "cpu-local.yaml"
    default = cli("plan", job)
    assert default.code == 0, default.err
    assert ("restart: up to 3 times after requeue or node_lost; not after failure or stall "
            "(restart.on); never after exit 2") in default.out
    budget = cli("plan", job, "--set", "restart.max=2")
    assert "restart: up to 2 times after requeue, node_lost or failure; not after stall" \
        in budget.out
    never = cli("plan", job, "--set", "restart.max=0")
    assert "restart: never (restart.max is 0)" in never.out


def test_the_written_policy_survives_the_supervisors_json() -> None:
    """loaded.json carries the job to a supervisor and to resume: the endings come back as
    they were decided, an explicit on: as it was written."""
    from orchestrate.core.spec.job import JobSpec

    for restart in ({"max": 3}, {"max": 3, "on": ["requeue"]}, None):
        data: dict[str, object] = {"name": "j", "command": ["python", "t.py"]}
        if restart is not None:
            data["restart"] = restart
        spec = JobSpec.model_validate(data)
        again = JobSpec.model_validate(spec.model_dump(mode="json"))
        assert again.restart == spec.restart
        unset = JobSpec.model_validate(spec.model_dump(mode="json", exclude_unset=True))
        assert unset.restart == spec.restart
