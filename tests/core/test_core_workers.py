"""Which worker of a node's launcher failed, from the launcher's own report
(orchestrate/core/plan/workers.py): mp.spawn's and torchrun's last lines, as they print them."""

from __future__ import annotations

import pytest

from orchestrate.core.plan.outcome import Exit, RankEnd
from orchestrate.core.plan.workers import worker_end

pytestmark = pytest.mark.unit

NODE_END = RankEnd(2, "h2", Exit(code=1), 5.0)  # the node's process, recorded as its first rank


def test_a_spawn_worker_killed_by_a_signal_is_the_failed_rank() -> None:
    lines = ["Traceback (most recent call last):", "  ...",
             "torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with "
             "signal SIGKILL"]
    end = worker_end(NODE_END, lines)
    assert (end.rank, end.node, end.exit) == (3, "h2", Exit(signal=9))


def test_a_spawn_worker_that_raised_or_exited_is_the_failed_rank() -> None:
    raised = ["torch.multiprocessing.spawn.ProcessRaisedException: ", "",
              "-- Process 0 terminated with the following error:", "Traceback ..."]
    assert worker_end(NODE_END, raised).rank == 2
    assert worker_end(NODE_END, raised).exit == Exit(code=1)
    exited = ["ProcessExitedException: process 1 terminated with exit code 3"]
    assert worker_end(NODE_END, exited).exit == Exit(code=3)


def test_torchruns_root_cause_names_the_global_rank() -> None:
    lines = ["Failures:", "  <NO_OTHER_FAILURES>", "Root Cause (first observed failure):",
             "[0]:", "  time      : 2026-12-02_01:00:00", "  host      : h2",
             "  rank      : 3 (local_rank: 1)", "  exitcode  : -9 (pid: 123)"]
    end = worker_end(NODE_END, lines)
    assert (end.rank, end.exit) == (3, Exit(signal=9))


def test_an_end_without_a_report_stays_the_nodes() -> None:
    assert worker_end(NODE_END, ["Killed"]) == NODE_END
    ok = RankEnd(0, "h1", Exit(code=0), 1.0)
    assert worker_end(ok, ["process 1 terminated with signal SIGKILL"]) == ok
