"""How a rank's ending is named: a collective timeout in its last log lines is the cause,
however the process then ended (issue #25 item 14)."""

from __future__ import annotations

import pytest

from orchestrate.core.plan.outcome import Exit, Failure, RankEnd, collective_timeout

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
