"""``submit --follow`` ends when the supervisor says the job's end is recorded, not at a later look.

The supervisor keeps its verdict pipe open after a launch and closes it once the job's end (and
its report) is written; the CLI's follow loop wakes on that end of file and reads the state at
once. Each test would wait for the slow look (30 s here) without the wake: the bounds are
generous (a busy machine), yet far below it.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrate.backends.handshake import read_verdict
from orchestrate.cli import follow as follow_module
from orchestrate.cli.follow import follow
from orchestrate.core.plan.plan import make_plan
from orchestrate.run.jobrecord import JobState
from orchestrate.run.store import JobRecord, RankRecord
from tests.support import plans

SLOW_LOOK_S = 30.0

#: A supervisor's verdict side alone: launched (or refused), then the job's end on a line of
#: stdin, then a long sleep: an end of file seen before the sleep ends came from ``ended()``.
_SUPERVISOR = """
import sys, time
from orchestrate.backends.handshake import Verdict, VerdictLine
verdict = VerdictLine()
verdict.send(Verdict(ok=sys.argv[1] == "ok"))
sys.stdin.readline()
verdict.ended()
time.sleep(60)
"""


def _job(tmp_path: Path, state: JobState) -> JobRecord:
    spec = plans.job(command=["python", "x.py"])
    plan = make_plan(spec, plans.inventory({"name": "n1", "slots": 2}), job_id="f-1",
                     run_dir=str(tmp_path), workdir=str(tmp_path))
    return JobRecord(id="f-1", name="j", backend="local", state=state,
                     run_dir=str(tmp_path), plan=plan, submitted_at=1.0,
                     ranks=[RankRecord(rank=r, node="n1") for r in range(2)])


@pytest.mark.unit
def test_follow_reads_the_state_as_soon_as_the_wake_pipe_closes(tmp_path: Path) -> None:
    running, ended = _job(tmp_path, "RUNNING"), _job(tmp_path, "COMPLETED")
    recorded, looked = threading.Event(), threading.Event()
    read, write = os.pipe()
    looks: list[float] = []

    def refresh() -> JobRecord:
        looks.append(time.monotonic())
        found = ended if recorded.is_set() else running
        looked.set()
        return found

    def end_the_job() -> None:
        looked.wait(SLOW_LOOK_S)  # after follow's first look, however slow the machine
        recorded.set()
        os.close(write)

    ender = threading.Thread(target=end_the_job)
    ender.start()
    with open(read, "rb", buffering=0) as wake, open(os.devnull, "wb") as out:
        started = time.monotonic()
        final = follow(running, refresh, out=out, refresh_every_s=SLOW_LOOK_S, wake=wake)
    took = time.monotonic() - started
    ender.join()
    assert final.state == "COMPLETED"
    assert len(looks) == 2, looks  # the first look, then the one the end of file asked for
    assert took < SLOW_LOOK_S / 3, took


@pytest.mark.unit
def test_follow_returns_only_after_the_supervisor_closes_the_pipe(tmp_path: Path) -> None:
    # The store says COMPLETED at the first look, but the supervisor still writes the report:
    # follow (submit --follow) returns only once the pipe closes, so a user or a script that
    # opens the run directory next finds it complete (the CI failure of stop 45).
    ended = _job(tmp_path, "COMPLETED")
    looked, closed = threading.Event(), threading.Event()
    read, write = os.pipe()

    def refresh() -> JobRecord:
        looked.set()
        return ended

    def finish_the_report() -> None:
        looked.wait(SLOW_LOOK_S)
        time.sleep(0.3)  # the report being written after the end was recorded
        closed.set()
        os.close(write)

    writer = threading.Thread(target=finish_the_report)
    writer.start()
    with open(read, "rb", buffering=0) as wake, open(os.devnull, "wb") as out:
        final = follow(ended, refresh, out=out, refresh_every_s=SLOW_LOOK_S, wake=wake)
        returned_after_close = closed.is_set()
    writer.join()
    assert final.state == "COMPLETED"
    assert returned_after_close


@pytest.mark.unit
def test_a_supervisor_that_never_closes_its_pipe_delays_follow_a_bounded_time_and_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(follow_module, "END_WAIT_S", 0.3)
    ended = _job(tmp_path, "COMPLETED")
    read, write = os.pipe()
    try:
        with open(read, "rb", buffering=0) as wake, open(os.devnull, "wb") as out:
            started = time.monotonic()
            final = follow(ended, lambda: ended, out=out, refresh_every_s=SLOW_LOOK_S,
                           wake=wake)
            took = time.monotonic() - started
    finally:
        os.close(write)
    assert final.state == "COMPLETED"
    assert 0.3 <= took < SLOW_LOOK_S / 3, took
    said = capsys.readouterr().err
    assert "job f-1 ended, but its supervisor had not finished" in said
    assert str(tmp_path / "supervisor.log") in said


def _supervisor(word: str) -> subprocess.Popen[bytes]:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", _SUPERVISOR, word], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)


def _closed_within(fd: int, seconds: float) -> bool:
    ready, _, _ = select.select([fd], [], [], seconds)
    return bool(ready) and os.read(fd, 4096) == b""


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_launched_jobs_pipe_stays_open_until_its_end_is_recorded() -> None:
    proc = _supervisor("ok")
    assert proc.stdin is not None and proc.stdout is not None
    try:
        verdict = read_verdict(proc.stdout, 30)
        assert verdict is not None and verdict.ok
        assert not _closed_within(proc.stdout.fileno(), 0.3)  # the job runs: no end yet
        proc.stdin.write(b"ended\n")
        proc.stdin.flush()
        assert _closed_within(proc.stdout.fileno(), 20)
        assert proc.poll() is None  # closed by ended(), not by the process's exit
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_refused_jobs_pipe_closes_with_the_verdict() -> None:
    proc = _supervisor("refused")
    assert proc.stdout is not None
    try:
        verdict = read_verdict(proc.stdout, 30)
        assert verdict is not None and not verdict.ok
        assert _closed_within(proc.stdout.fileno(), 20)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()

