"""How a rank's ending is named: a collective timeout in its last log lines is the cause,
however the process then ended (issue #25 item 14); the rank that explains a failure is the one
named (issue #33 item 3)."""

from __future__ import annotations

import pytest

from orchestrate.core.plan.outcome import (
    ELSEWHERE,
    EXPLAINED,
    SETTLE_S,
    SILENT,
    Exit,
    Failure,
    RankEnd,
    collective_timeout,
    first_failure,
    says,
    settled,
)

pytestmark = pytest.mark.unit

#: A real gloo rank's last line after a 3 s timeout (torch 2.13.0+cpu, tests/diagnosis/programs/
#: timeout.py).
GLOO = ("failed after 3.0 s: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/"
        "transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to "
        "complete")
#: nccl's watchdog, as users have reported it (no GPU here to make one).
NCCL = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=668, "
        "OpType=ALLREDUCE, NumelIn=52, NumelOut=52, Timeout(ms)=600000) ran for 600097 "
        "milliseconds before timing out.")


def _failure(lines: list[str], exit: Exit, cause: str | None = None) -> Failure:
    return Failure.of(RankEnd(0, "h1", exit, 1.0), lines, cause)


def test_a_timeout_is_the_cause_whichever_way_the_rank_ended() -> None:
    assert collective_timeout([GLOO]) == "collective timed out after 3 s"
    assert collective_timeout(["x", NCCL, "terminate called after throwing an instance of "
                               "'c10::DistBackendError'"]) == (
        "collective timed out after 600 s (ALLREDUCE #668)")
    assert collective_timeout(["Traceback", "RuntimeError: Connection closed by peer"]) is None
    aborted = _failure([GLOO, "terminate called without an active exception"], Exit(signal=6))
    assert aborted.sentence() == ("rank 0 on h1: collective timed out after 3 s (it then ended "
                                  "with signal 6 (SIGABRT))")
    assert _failure([GLOO], Exit(code=3)).sentence() == (
        "rank 0 on h1: collective timed out after 3 s (it then ended with exit code 3)")
    assert _failure(["boom"], Exit(code=1)).sentence() == "rank 0 on h1 failed with exit code 1"
    lost = _failure([GLOO], Exit(signal=9), cause="lost contact with h1")
    assert lost.sentence().startswith("lost contact with h1 (rank 0")


def test_a_rank_that_explains_outranks_one_that_died_first_saying_nothing() -> None:
    """Issue #33 item 3: rank 1 ended 0.5 s before rank 0, which printed why they both stop."""
    said = {0: ["rank 0: the loss is not finite (NaN or inf) at epoch 1, by step 3, on ranks 0, 1"],
            1: []}
    ends = [RankEnd(1, "h1", Exit(code=1), 10.0), RankEnd(0, "h1", Exit(code=1), 10.5)]
    assert first_failure(ends) == ends[0]  # without the logs: the earliest
    assert first_failure(ends, lambda r: said[r]) == ends[1]
    # Too late to be the same failure: the earliest again.
    late = [ends[0], RankEnd(0, "h1", Exit(code=1), 10.0 + SETTLE_S + 1)]
    assert first_failure(late, lambda r: said[r]) == late[0]
    # A rank killed saying nothing (an OOM kill) outranks one that blames another rank.
    peer = {0: ["rank 0: training failed in epoch 1 after step 4: RuntimeError: Connection "
                "closed by peer (a collective failed: another rank probably failed first; look "
                "for its message)"], 1: []}
    killed = [RankEnd(0, "h1", Exit(code=1), 10.0), RankEnd(1, "h2", Exit(signal=9), 10.4)]
    assert first_failure(killed, lambda r: peer[r]) == killed[1]


def test_a_rank_that_asked_to_be_requeued_is_first_not_the_rank_srun_then_stopped() -> None:
    """The stop signal before the time limit: rank 0 checkpointed and exited 75, and srun then
    stopped rank 1 (SIGTERM, silent). Rank 0's own line reads like a stop from outside, yet it
    is the first: the attempt is a requeue, not a failure restarted in the allocation (CI)."""
    said = {0: ["stopped by SIGUSR2 at step 31; checkpointed, exiting 75 to be requeued"],
            1: []}
    ends = [RankEnd(0, "n1", Exit(code=75), 10.0), RankEnd(1, "n2", Exit(signal=15), 10.1)]
    assert says(said[0]) == ELSEWHERE  # the words alone would have blamed rank 1
    assert first_failure(ends, lambda r: said[r]) == ends[0]
    assert settled(ends, lambda r: said[r], running=True, now=10.0 + SETTLE_S) == ends[0]
    # A rank killed before any asked is a failure of its own: it stays first.
    early = [RankEnd(1, "n2", Exit(signal=9), 9.9), *ends[:1]]
    assert first_failure(early, lambda r: said[r]) == early[0]


@pytest.mark.parametrize(("lines", "verdict"), [
    (["rank 0: model factory m:f raised TypeError: f() got an unexpected keyword"], EXPLAINED),
    (["Traceback (most recent call last):", "  File \"x.py\"", "ValueError: bad"], EXPLAINED),
    (["epoch 1/3 loss 0.5", "Segmentation fault (core dumped)"], EXPLAINED),
    ([], SILENT),
    (["epoch 1/3 loss 0.5"], SILENT),
    (["rank 0: stopping: setup failed on rank(s) 1"], ELSEWHERE),
    (["Traceback (most recent call last):", "RuntimeError: Connection reset by peer"], ELSEWHERE),
    (["rank 2: interrupted"], ELSEWHERE),
    # torchrun's report of its failed worker (what the worker's node's log ends with) explains;
    # an agent that srun stopped after another node failed points elsewhere.
    (["Root Cause (first observed failure):", "[0]:", "  rank      : 3 (local_rank: 1)",
      "  exitcode  : 3 (pid: 921) ", "  error_file: <N/A>"], EXPLAINED),
    (["    time.sleep(monitor_interval)", "torch.distributed.elastic.multiprocessing.api."
      "SignalException: Process 736 got signal: 15"], ELSEWHERE),
])
def test_what_a_failed_ranks_last_lines_say(lines: list[str], verdict: int) -> None:
    assert says(lines) == verdict


def test_a_silent_failure_waits_for_a_rank_still_running_but_not_forever() -> None:
    said: dict[int, list[str]] = {0: [], 1: ["ValueError: mine"]}
    silent = [RankEnd(0, "h1", Exit(code=1), 10.0)]
    assert settled(silent, lambda r: said[r], running=True, now=11.0) is None
    assert settled(silent, lambda r: said[r], running=True, now=10.0 + SETTLE_S) == silent[0]
    assert settled(silent, lambda r: said[r], running=False, now=10.1) == silent[0]
    explained = [RankEnd(1, "h1", Exit(code=1), 10.0)]
    assert settled(explained, lambda r: said[r], running=True, now=10.0) == explained[0]
    assert settled([RankEnd(0, "h1", Exit(code=0), 10.0)], lambda r: [], True, 20.0) is None
