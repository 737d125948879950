"""How long ranks may outlive the job's work (run/linger.py): the rule the local and SSH
supervisor and the Slurm batch job's watch share, on a clock the test moves."""

from __future__ import annotations

import pytest

from orchestrate.diagnosis.stall import TEARDOWN
from orchestrate.run.linger import EARLY_EXIT_NOTICE_S, LINGER_SLACK_S, Linger, linger_s

pytestmark = pytest.mark.unit

TIMEOUT_S = 60.0


def test_the_bound_is_the_process_group_timeout_and_the_slack() -> None:
    assert linger_s(TIMEOUT_S) == TIMEOUT_S + LINGER_SLACK_S


def test_ranks_left_when_rank_0_finished_are_noted_once_then_stopped_past_the_bound() -> None:
    linger = Linger(linger_s(TIMEOUT_S))
    linger.exited(0, "a", now=100.0)
    assert linger.notice(100.0 + EARLY_EXIT_NOTICE_S / 2, [1, 2]) is None
    notice = linger.notice(100.0 + EARLY_EXIT_NOTICE_S + 1, [1, 2])
    assert notice is not None and notice.startswith("rank 0 on a exited 0 more than "), notice
    assert f"still running {linger.linger_s:.0f}s after it" in notice, notice
    assert linger.notice(100.0 + EARLY_EXIT_NOTICE_S + 2, [1, 2]) is None  # said once
    assert linger.overdue(100.0 + linger.linger_s - 1, [1, 2]) is None
    due = linger.overdue(100.0 + linger.linger_s + 1, [1, 2])
    assert due is not None and due.reason.startswith("rank(s) [1, 2] still ran "), due
    assert "after rank 0 finished" in due.reason and not due.hung


def test_a_rank_other_than_0_finishing_first_is_only_noted() -> None:
    """Rank 0 may still save; the others fail at the process-group timeout if they wait."""
    linger = Linger(linger_s(TIMEOUT_S))
    linger.exited(2, "b", now=0.0)
    linger.exited(1, "b", now=1.0)
    notice = linger.notice(EARLY_EXIT_NOTICE_S + 5, [0])
    assert notice is not None and notice.startswith("rank 2 on b exited 0"), notice
    assert "fail at the process-group timeout" in notice
    assert linger.overdue(1e6, [0]) is None


def test_ranks_hung_in_their_exit_are_stopped_past_the_bound_from_when_they_were_named() -> None:
    """Rank 0 hung in its exit: the rank-0 rule never starts (rank 0 did not finish), so
    without this bound such a job would run until its time limit."""
    linger = Linger(linger_s(TIMEOUT_S))
    linger.exited(1, "b", now=10.0)
    assert linger.named("laggard", now=40.0) is None  # any other kind: the job goes on
    assert linger.overdue(1e6, [0]) is None
    said = linger.named(TEARDOWN, now=50.0)
    assert said is not None and said.endswith(
        f"stopped if still not exited {linger.linger_s:.0f}s from now"), said
    again = linger.named(TEARDOWN, now=60.0)  # named again: the clock keeps its start
    assert again is not None and again.endswith(f"{linger.linger_s - 10:.0f}s from now"), again
    assert linger.overdue(50.0 + linger.linger_s - 1, [0]) is None
    due = linger.overdue(50.0 + linger.linger_s + 1, [0])
    assert due is not None and due.reason.startswith("rank(s) [0] ended their programs but "
                                                     "still had not exited "), due
    assert "teardown" in due.reason and due.hung
