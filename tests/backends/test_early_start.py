"""``submit`` starts the supervisor before it plans (orchestrate/backends/early.py).

What a user checks: a job submitted this way is seen running (its supervisor is known as the
job's by its command line, which names the job only by its id's suffix) and cancels as before;
a submit refused while planning leaves no process behind.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from orchestrate.backends import early
from orchestrate.backends.early import Go, names
from orchestrate.run.store import Store
from tests.support.localcli import Cli

SLEEPER = """
name: sleeper
resources: {nodes: 1, gpus_per_node: 1}
command: [python, -c, "import time; time.sleep(60)"]
"""


def _early_processes(home: Path) -> list[int]:
    """This test's early supervisors still running (their environment names its store)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"orchestrate.backends.early" in cmdline and str(home).encode() in environ:
            found.append(int(entry.name))
    return found


@pytest.mark.unit
def test_the_command_line_names_the_job_by_its_id_or_its_suffix() -> None:
    assert names(b"sleeper-a1b2c3", b"sleeper-a1b2c3")
    assert names(b"*-a1b2c3", b"sleeper-a1b2c3")
    assert not names(b"*-a1b2c4", b"sleeper-a1b2c3")
    assert not names(b"*-", b"sleeper-")  # no suffix names no job
    assert not names(b"-a1b2c3", b"sleeper-a1b2c3")
    go = Go("orchestrate.backends.local.supervisor", "j-1", "/s/jobs.db", "/r/supervisor.log")
    assert Go.from_json(go.to_json()) == go


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_job_whose_supervisor_started_early_runs_and_cancels(cli: Cli) -> None:
    cli.write("job.yaml", SLEEPER)
    job = cli.run("submit", "job.yaml", "--detach", check=True).stdout.strip()
    assert cli.status(job)["state"] == "RUNNING"
    record = Store(cli.home / "jobs.db").get(job)
    assert record is not None and record.supervisor_pid is not None
    pid = record.supervisor_pid
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"orchestrate.backends.early" in cmdline and b"*-" + job.rsplit("-", 1)[1].encode() \
        in cmdline
    assert cli.status(job)["state"] == "RUNNING"  # not "the job's supervisor process vanished"
    # It launched without the job's spec models (orchestrate/run/loaded.py): pydantic's
    # compiled core is not loaded in it; loaded.json is written all the same.
    assert "pydantic_core" not in Path(f"/proc/{pid}/maps").read_text()
    loaded = json.loads((Path(record.run_dir) / "loaded.json").read_text())
    assert loaded["job"]["name"] == "sleeper"
    cancelled = cli.run("cancel", job, check=True)
    assert cli.status(job)["state"] == "CANCELLED", cancelled.stderr


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_submit_refused_while_planning_leaves_no_process(cli: Cli) -> None:
    cli.write("bad.yaml", "name: bad\n")
    refused = cli.run("submit", "bad.yaml", "--detach")
    assert refused.returncode == 2 and "bad.yaml:1:" in refused.stderr
    deadline = time.monotonic() + 60  # it ends as soon as it reads the end of its stdin
    while _early_processes(cli.home) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _early_processes(cli.home) == []
    assert not (cli.work / "runs").exists() or not os.listdir(cli.work / "runs")


@pytest.mark.unit
@pytest.mark.parametrize("argv", [
    ["submit", "job.yaml", "--job-id", "x"], ["submit", "--job-id=x", "job.yaml"],
    ["submit", "job.yaml", "--dry-run"], ["submit", "--help"], ["submit", "-h"],
    ["status", "job"], ["--debug", "submit", "job.yaml"], [],
])
def test_only_a_plain_submit_starts_its_supervisor_before_click(
        argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(early, "ENABLED", True)
    monkeypatch.setattr(early, "_PRESTARTED", None)
    early.prestart(argv)  # a unit test may start no process: any start would fail here
    assert early._PRESTARTED is None


@pytest.mark.process
def test_submit_takes_the_supervisor_started_before_click(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(early, "ENABLED", True)
    monkeypatch.setattr(early, "_PRESTARTED", None)
    early.prestart(["submit", "job.yaml", "--follow"])
    assert early._PRESTARTED is not None
    started, suffix = early._PRESTARTED
    assert started is not None and suffix is not None
    other, _ = early.Early.start("given-id")  # --job-id: a program of its own
    assert other is not None and other is not started
    other.close()
    taken, taken_suffix = early.Early.start(None)
    assert taken is started and taken_suffix == suffix and early._PRESTARTED is None
    cmdline = Path(f"/proc/{started.proc.pid}/cmdline").read_bytes().split(b"\0")
    assert ("*-" + suffix).encode() in cmdline
    started.close()
    assert started.proc.wait(timeout=60) == 0  # the end of its stdin ends it
    assert other.proc.wait(timeout=60) == 0

