"""Ctrl-C in a view of a job leaves the view, never the job; only ``submit --follow`` cancels.

Real local jobs, real ``python -m orchestrate`` processes on a pseudo-terminal, and Ctrl-C as the
terminal sends it (SIGINT to the command's process group). A job here runs until the test
creates its ``done`` file, so "still running after Ctrl-C" does not depend on the machine's pace.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrate.hostside import host
from tests.support.localcli import Cli
from tests.support.terminals import Terminal

pytestmark = pytest.mark.process


def _until_done_job(cli: Cli, name: str) -> tuple[Path, Path]:
    done = cli.work / f"{name}.done"
    job = cli.write(f"{name}.yaml", f"""
        name: {name}
        resources: {{nodes: 1, gpus_per_node: 2}}
        env: {{DONE: '{done}'}}
        command: [bash, -c, 'while [ ! -e "$DONE" ]; do echo "tick $RANK"; sleep 0.2; done']
        """)
    return job, done


def _until(cli: Cli, job: str, states: tuple[str, ...], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        proc = cli.run("status", job, "--json")
        state = cli.status(job)["state"] if proc.returncode == 0 else "-"
        if state in states:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job} is {state}, never {states}")
        time.sleep(0.2)


@pytest.fixture
def terminals() -> Iterator[list[Terminal]]:
    opened: list[Terminal] = []
    yield opened
    for terminal in opened:
        terminal.close()


def _leaves_the_view_not_the_job(cli: Cli, terminals: list[Terminal], name: str,
                                 view: tuple[str, ...], shown: str) -> None:
    job_file, done = _until_done_job(cli, name)
    job = cli.id(name)
    cli.run("submit", str(job_file), "--detach", "--job-id", job, check=True)
    _until(cli, job, ("RUNNING",))
    terminal = Terminal.orchestrate(*view, job, cwd=cli.work, env=cli.env)
    terminals.append(terminal)
    terminal.wait_for(shown, timeout=60)
    pids = {r["rank"]: r["pid"] for r in cli.status(job)["ranks"]}
    terminal.interrupt()
    assert terminal.wait(timeout=30) == 130, terminal.text()
    text = terminal.text()
    assert f"job {job} keeps running" in text and f"orchestrate cancel {job}" in text, text
    assert "Traceback" not in text
    assert cli.status(job)["state"] == "RUNNING"
    assert all(pid in host.job_pids(job) for pid in pids.values()), "a rank was touched"
    done.write_text("")
    assert _until(cli, job, ("COMPLETED", "FAILED", "CANCELLED")) == "COMPLETED"


@pytest.mark.timeout(180)
def test_ctrl_c_in_logs_follow_leaves_the_job_running(cli: Cli,
                                                      terminals: list[Terminal]) -> None:
    _leaves_the_view_not_the_job(cli, terminals, "tail", ("logs", "-f"), r"tick 1")


@pytest.mark.timeout(180)
def test_ctrl_c_in_status_watch_leaves_the_job_running(cli: Cli,
                                                       terminals: list[Terminal]) -> None:
    _leaves_the_view_not_the_job(cli, terminals, "watch", ("status", "--watch"),
                                 r"Ctrl-C leaves the view")


@pytest.mark.timeout(180)
def test_ctrl_c_in_submit_follow_cancels_and_exits_130(cli: Cli,
                                                       terminals: list[Terminal]) -> None:
    job_file, _ = _until_done_job(cli, "follow")
    job = cli.id("follow")
    terminal = Terminal.orchestrate("submit", str(job_file), "--follow", "--job-id", job,
                                    cwd=cli.work, env=cli.env)
    terminals.append(terminal)
    first = terminal.wait_for(r"tick 1", timeout=60)
    assert f"job {job} submitted (local)" in first and "Ctrl-C cancels it" in first, first
    terminal.interrupt()
    assert terminal.wait(timeout=60) == 130, terminal.text()
    assert f"cancelling job {job}" in terminal.text()
    assert cli.status(job)["state"] == "CANCELLED"
    assert host.job_pids(job) == []


def test_the_help_says_what_ctrl_c_does(cli: Cli) -> None:
    submit = " ".join(cli.run("submit", "--help", check=True).stdout.split())
    assert "Ctrl-C then cancels the job and exits 130" in submit
    logs = " ".join(cli.run("logs", "--help", check=True).stdout.split())
    assert "Ctrl-C stops printing (exit 130), the job runs on" in logs
    watch = " ".join(cli.run("status", "--help", check=True).stdout.split())
    assert "Ctrl-C leaves the view (exit 130), the job runs on" in watch
