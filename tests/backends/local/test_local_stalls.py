"""A stuck local job names the stuck rank: the stall watch in the supervisor, ``diagnose``.

Real ranks (gloo on CPU) started by ``orchestrate submit`` run a plain Python program that
imports nothing of orchestrate (tests/diagnosis/programs/steps.py: steps of one all_reduce each; a
scenario in its environment makes one rank misbehave), or the built-in trainer with a dataset
whose read never returns on one rank. The sidecar reaches them as sitecustomize, the supervisor's
watch names the stall, and the job record, ``diag/diagnosis.json`` and ``orchestrate diagnose``
say the same sentence. ``stall_s`` is 10 s here (the least allowed) to keep the tests short.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.localcli import Cli
from tests.support.output import merged_text

pytestmark = [pytest.mark.process, pytest.mark.torch, pytest.mark.timing]

PROGRAMS = Path(__file__).resolve().parents[2] / "diagnosis" / "programs"
REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "digits"
STALL_S = 10


def _steps_job(cli: Cli, name: str, scenario: str, *, on_stall: str = "kill",
               restart: str = "{max: 0}", extra_env: str = "", bad_rank: int = 1,
               timeout_s: int = 300) -> Path:
    marks = cli.work / f"marks-{name}"
    marks.mkdir(exist_ok=True)
    return cli.write(f"{name}.yaml", f"""
        name: {name}
        resources: {{nodes: 1, gpus_per_node: 2}}
        distributed: {{backend: gloo, stall_s: {STALL_S}, on_stall: {on_stall},
                       timeout_s: {timeout_s}}}
        restart: {restart}
        env: {{SCENARIO: {scenario}, BAD_RANK: {bad_rank}, TRIGGER_STEP: 8, MARKS: '{marks}'
               {extra_env}}}
        command: [python3, '{PROGRAMS / "steps.py"}']
        """)


def _until(cli: Cli, job: str, done: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status = cli.status(job)
        if done(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.3)


def _trigger_time(cli: Cli, name: str, mark: str = "trigger", timeout: float = 90,
                  job: str | None = None) -> float:
    """When the job's program reached ``mark``; fails after ``timeout`` s, with the job's status
    (``job``: its id) to tell a slow machine from a job that ended first."""
    path = cli.work / f"marks-{name}" / mark
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            status = cli.status(job) if job is not None else None
            raise AssertionError(f"the program never reached its {mark} mark in {timeout} s; "
                                 f"the job: {status}")
        time.sleep(0.1)
    time.sleep(0.05)
    return float(path.read_text())


def test_a_laggard_is_named_and_killed_within_the_bound(cli: Cli) -> None:
    job = cli.id("lag")
    cli.run("submit", str(_steps_job(cli, "lag", "laggard")), "--detach", "--job-id", job,
            check=True)
    began = _trigger_time(cli, "lag")
    status = _until(cli, job, lambda s: s["state"] not in ("PENDING", "RUNNING"), 120)
    took = (status["diagnosis"] or {}).get("at", float("inf")) - began
    assert status["state"] == "FAILED", status
    diagnosis = status["diagnosis"]
    assert diagnosis["kind"] == "laggard" and diagnosis["ranks"] == [1], diagnosis
    summary = diagnosis["summary"]
    assert summary.startswith("rank 1 (node localhost) has not reached collective #")
    assert "steps.py" in summary and "rank 0 waits in all_reduce" in summary
    assert status["reason"] == f"stalled: {summary}"
    # The rule's bound plus the collection, with slack for a loaded 2-core machine.
    assert took < STALL_S + 30, took
    run_dir = Path(status["run_dir"])
    assert json.loads((run_dir / "diag" / "diagnosis.json").read_text())["summary"] == summary
    stacks = [Path(f) for f in diagnosis["files"] if f.endswith("rank-1.stacks.txt")]
    assert stacks and "steps.py" in stacks[0].read_text()
    # Every rank was stopped: none is left.
    assert all(r["state"] in ("STOPPED", "FAILED") for r in status["ranks"]), status["ranks"]


def test_a_mismatched_collective_is_named(cli: Cli) -> None:
    job = cli.id("mis")
    cli.run("submit", str(_steps_job(cli, "mis", "mismatch")), "--detach", "--job-id", job,
            check=True)
    status = _until(cli, job, lambda s: s["state"] not in ("PENDING", "RUNNING"), 120)
    diagnosis = status["diagnosis"]
    assert diagnosis["kind"] == "mismatch", diagnosis
    assert diagnosis["ranks"] == [1]
    assert "rank 1 (node localhost) is in barrier #" in diagnosis["summary"]
    assert "rank 0 is in all_reduce #" in diagnosis["summary"]


def test_a_frozen_rank_is_named_while_the_job_goes_on_and_diagnose_answers(cli: Cli) -> None:
    """``on_stall: report``: named, not killed; ``diagnose`` answers in seconds although one
    rank cannot answer at all."""
    job = cli.id("frz")
    cli.run("submit", str(_steps_job(cli, "frz", "frozen", on_stall="report")), "--detach",
            "--job-id", job, check=True)
    _trigger_time(cli, "frz", mark="ready")
    status = cli.status(job)
    pid = next(r["pid"] for r in status["ranks"] if r["rank"] == 1)
    os.kill(pid, signal.SIGSTOP)
    try:
        status = _until(cli, job, lambda s: s["diagnosis"] is not None, 90)
        diagnosis = status["diagnosis"]
        assert diagnosis is not None, status
        assert diagnosis["kind"] == "frozen" and diagnosis["ranks"] == [1], diagnosis
        assert f"rank 1 (node localhost, pid {pid}) stopped answering" in diagnosis["summary"]
        assert status["state"] == "RUNNING"  # report: the job goes on
        started = time.monotonic()
        found = cli.run("diagnose", job, "--json", check=True, timeout=60)
        assert time.monotonic() - started < 15
        table = json.loads(found.stdout)
        rows = {r["rank"]: r for r in table["ranks"]}
        assert rows[1]["answered"] is False and rows[0]["answered"] is True
        assert any("all_reduce" in c for c in rows[0]["collectives"]), rows[0]
        assert table["diagnosis"]["kind"] == "frozen"
        text = cli.run("diagnose", job, check=True, timeout=60).stdout
        assert "stopped answering" in text and "(silent)" in text
    finally:
        os.kill(pid, signal.SIGCONT)
        cli.run("cancel", job, timeout=60)


def test_a_rank_that_never_joins_is_named(cli: Cli) -> None:
    job = cli.id("rdv")
    cli.run("submit", str(_steps_job(cli, "rdv", "rendezvous")), "--detach", "--job-id", job,
            check=True)
    status = _until(cli, job, lambda s: s["state"] not in ("PENDING", "RUNNING"), 120)
    diagnosis = status["diagnosis"]
    assert diagnosis["kind"] == "rendezvous", diagnosis
    assert diagnosis["ranks"] == [1]
    assert "never reached init_process_group" in diagnosis["summary"]


def test_a_rank_hung_in_its_exit_is_named_and_stopped_where_the_others_have_exited(
        cli: Cli) -> None:
    """Rank 1 ends its program and then hangs in the interpreter's teardown, native code
    holding the GIL (programs/steps.py ``teardown``); rank 0 exits 0. The watch names rank 1
    and its pid, not rank 0 nor the sidecar's exit handler, and ``on_stall: kill`` ends it."""
    job = cli.id("tdn")
    path = _steps_job(cli, "tdn", "teardown", extra_env=", STEPS: 12")
    cli.run("submit", str(path), "--detach", "--job-id", job, check=True)
    began = _trigger_time(cli, "tdn", job=job)
    status = _until(cli, job, lambda s: s["state"] not in ("PENDING", "RUNNING"), 120)
    assert status["state"] == "FAILED", status
    diagnosis = status["diagnosis"]
    assert diagnosis is not None, status
    assert (diagnosis["kind"], diagnosis["ranks"]) == ("teardown", [1]), diagnosis
    pid = next(r["pid"] for r in status["ranks"] if r["rank"] == 1)
    assert diagnosis["summary"].startswith(
        f"rank 1 (node localhost, pid {pid}) ended its program "), diagnosis
    assert diagnosis["summary"].endswith("; rank 0 has exited"), diagnosis
    assert "sidecar" not in diagnosis["summary"]
    assert STALL_S * 0.8 <= diagnosis["at"] - began <= STALL_S + 30
    assert status["reason"].startswith("stalled: rank 1 (node localhost"), status
    exits = {r["rank"]: r["exit_code"] for r in status["ranks"]}
    assert exits[0] == 0 and exits[1] != 0, status


def test_rank_0_hung_in_its_exit_is_stopped_under_report_past_the_timeout(cli: Cli) -> None:
    """``on_stall: report`` (the default), rank 0 hangs in its exit, rank 1 exits 0: no
    process-group timeout ends that, and the rule for ranks outliving rank 0 never starts, so
    the job held its GPUs until its time limit. Named, it gets ``timeout_s`` + the slack (1 s
    here: the testing knob), then it is stopped: FAILED, saying so."""
    cli.env["ORCHESTRATE_LINGER_SLACK_S"] = "1"
    job = cli.id("tdr")
    path = _steps_job(cli, "tdr", "teardown", on_stall="report", bad_rank=0, timeout_s=10,
                      extra_env=", STEPS: 12")
    cli.run("submit", str(path), "--detach", "--job-id", job, check=True)
    status = _until(cli, job, lambda s: s["state"] not in ("PENDING", "RUNNING"), 120)
    assert status["state"] == "FAILED", status
    diagnosis = status["diagnosis"]
    assert diagnosis is not None and (diagnosis["kind"], diagnosis["ranks"]) == (
        "teardown", [0]), status
    assert status["reason"].startswith("rank(s) [0] ended their programs but still had not "
                                       "exited "), status["reason"]
    log = cli.run("logs", job, check=True).stdout
    assert "(distributed.on_stall: report: they are stopped if still not exited 11s from now)" \
        in log, log[-3000:]
    states = {r["rank"]: r["state"] for r in status["ranks"]}
    assert states == {0: "STOPPED", 1: "COMPLETED"}, status["ranks"]
    assert status["finished_at"] - diagnosis["at"] >= 11, (status["finished_at"], diagnosis)


def test_a_stall_restarts_under_the_policy(cli: Cli) -> None:
    """``restart.on: [stall]``: the killed attempt is followed by another (which stalls too,
    and the budget ends it)."""
    job = cli.id("rst")
    path = _steps_job(cli, "rst", "laggard",
                      restart="{max: 1, on: [stall], backoff_s: [0]}")
    cli.run("submit", str(path), "--detach", "--job-id", job, check=True)
    status = _until(cli, job, lambda s: s["state"] not in ("PENDING", "RUNNING", "RESTARTING"),
                    200)
    assert status["state"] == "FAILED", status
    attempts = status["attempts"]
    assert len(attempts) == 2, attempts
    assert attempts[0]["reason"].startswith("stalled: rank 1 (node localhost)")
    assert "restart 1 of at most 1" in attempts[0]["reason"]


def test_a_long_rank0_pause_shorter_than_the_bound_is_not_a_stall(cli: Cli) -> None:
    job = cli.id("ok")
    path = _steps_job(cli, "ok", "healthy", extra_env=", STEPS: 30, PAUSE_S: 6")
    cli.run("submit", str(path), "--detach", "--job-id", job, check=True)
    status = _until(cli, job, lambda s: s["state"] not in ("PENDING", "RUNNING"), 120)
    assert status["state"] == "COMPLETED", status
    assert status["diagnosis"] is None
    assert (cli.work / "marks-ok" / "pause").exists()  # the pause happened


def test_a_train_job_stuck_in_its_data_loading_is_named(cli: Cli) -> None:
    job = cli.id("trn")
    marks = cli.work / "marks-trn"
    marks.mkdir()
    path = cli.write("trn.yaml", f"""
        name: trn
        resources: {{nodes: 1, gpus_per_node: 2}}
        workdir: {EXAMPLE}
        distributed: {{backend: gloo, stall_s: {STALL_S}, on_stall: kill, timeout_s: 300}}
        restart: {{max: 0}}
        env: {{PYTHONPATH: '{REPO}:{PROGRAMS}', MARKS: '{marks}'}}
        train:
          model: digits:build_model
          dataset: stuck_data:build_dataset
          dataset_args: {{stuck_rank: 1, after: 300}}
          optimizer: {{name: adamw, lr: 3.0e-3}}
          epochs: 5
          batch_size: 16
        """)
    cli.run("submit", str(path), "--detach", "--job-id", job, check=True)
    status = _until(cli, job, lambda s: s["state"] not in ("PENDING", "RUNNING"), 180)
    diagnosis = status["diagnosis"]
    assert status["state"] == "FAILED" and diagnosis is not None, status
    assert diagnosis["kind"] == "laggard" and diagnosis["ranks"] == [1], diagnosis
    assert "stuck_data.py" in diagnosis["summary"], diagnosis["summary"]


def _slow_train_job(cli: Cli, name: str, slow: str, restart: str) -> Path:
    """A ``train:`` job whose rank 0 waits 25 s on slow storage (tests/diagnosis/programs/
    slow_train.py: the main thread sleeps in read(2) on a file) in its first checkpoint
    (``slow: model``) or its first validation read (``slow: dataset``)."""
    marks = cli.work / f"marks-{name}"
    marks.mkdir()
    model = ("slow_train:build_model\n          model_args: {hidden: 32, slow_s: 25}"
             if slow == "model" else "digits:build_model\n          model_args: {hidden: 32}")
    dataset = ("slow_train:build_dataset\n          dataset_args: {slow_s: 25}"
               if slow == "dataset" else "digits:build_dataset")
    return cli.write(f"{name}.yaml", f"""
        name: {name}
        resources: {{nodes: 1, gpus_per_node: 2}}
        workdir: {EXAMPLE}
        distributed: {{backend: gloo, stall_s: {STALL_S}, on_stall: kill, timeout_s: 300}}
        restart: {restart}
        env: {{PYTHONPATH: '{REPO}:{PROGRAMS}', MARKS: '{marks}'}}
        train:
          model: {model}
          dataset: {dataset}
          optimizer: {{name: adamw, lr: 3.0e-3}}
          epochs: 2
          batch_size: 64
          checkpoint_dir: {cli.work / f"ckpt-{name}"}
        """)


def _supervisor_notes(status: dict[str, Any]) -> list[str]:
    merged = merged_text(Path(status["run_dir"]))
    return [line for line in merged.splitlines()
            if line.startswith("[orchestrate] no progress for")]


def test_a_slow_checkpoint_is_not_a_stall_nor_a_restart_loop(cli: Cli) -> None:
    """Issue #25 item 1: rank 0's checkpoint blocked 25 s on slow storage, ``stall_s`` 10,
    ``on_stall: kill``, ``restart.on: [stall]``: the job completes in its one attempt, and the
    supervisor's log says why it was not a stall."""
    job = cli.id("ckp")
    path = _slow_train_job(cli, "ckp", "model", "{max: 2, on: [stall], backoff_s: [0]}")
    cli.run("submit", str(path), "--detach", "--job-id", job, check=True)
    _trigger_time(cli, "ckp", timeout=150, job=job)
    status = _until(cli, job, lambda s: s["state"] not in ("PENDING", "RUNNING", "RESTARTING"),
                    240)
    assert status["state"] == "COMPLETED", status
    assert status["diagnosis"] is None and len(status["attempts"]) == 1, status
    notes = _supervisor_notes(status)
    assert len(notes) == 1, notes
    assert "but not stalled: rank 0 (node localhost) in slow I/O at slowstore.py:" in notes[0]
    # rank 0's clause (the file it reads, its phase); rank 1 waits for it in the checkpoint
    assert "(read of " in notes[0] and "), phase checkpoint" in notes[0], notes
    assert "(a stall only after distributed.busy_s" in notes[0], notes
    assert "(a stall only after distributed.busy_s, 1800 s without progress)" in notes[0]


def test_a_slow_validation_read_is_not_a_stall(cli: Cli) -> None:
    job = cli.id("evl")
    path = _slow_train_job(cli, "evl", "dataset", "{max: 0}")
    cli.run("submit", str(path), "--detach", "--job-id", job, check=True)
    _trigger_time(cli, "evl", timeout=150, job=job)
    status = _until(cli, job, lambda s: s["state"] not in ("PENDING", "RUNNING"), 240)
    assert status["state"] == "COMPLETED", status
    assert status["diagnosis"] is None, status
    notes = _supervisor_notes(status)
    assert len(notes) == 1, notes
    assert "but not stalled: rank 0 (node localhost) in slow I/O at slowstore.py:" in notes[0]
    # rank 1 waits for rank 0's shard in eval's all_reduce: in eval too, said but not needed
    assert "), phase eval; rank 1 (node localhost) in eval at evaluate.py:" in notes[0], notes
