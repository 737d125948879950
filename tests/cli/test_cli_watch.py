"""``status --watch`` on a real stuck ``command:`` job: the view names the stall as ``status``
does, shows what each rank does (phase, step, collectives) instead of waiting for steps that a
``command:`` job never reports, and the stuck rank's progress age grows although its sidecar
keeps beating.

The job is a plain DDP program (tests/diagnosis/programs/steps.py, no orchestrate import) whose
rank 1 stops in a data read at step 8 while rank 0 waits in all_reduce; ``on_stall: report``
keeps it running, ``stall_s`` is 10 s (the least allowed).
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.localcli import Cli
from tests.support.terminals import Terminal

pytestmark = [pytest.mark.process, pytest.mark.torch, pytest.mark.timing]

PROGRAMS = Path(__file__).resolve().parents[1] / "diagnosis" / "programs"


@pytest.fixture
def stuck(cli: Cli) -> Iterator[str]:
    job = cli.id("stuck")
    marks = cli.work / "marks"
    marks.mkdir()
    path = cli.write("stuck.yaml", f"""
        name: stuck
        resources: {{nodes: 1, gpus_per_node: 2}}
        distributed: {{backend: gloo, stall_s: 10, on_stall: report, timeout_s: 300}}
        env: {{SCENARIO: laggard, BAD_RANK: 1, TRIGGER_STEP: 8, MARKS: '{marks}'}}
        command: [{sys.executable}, '{PROGRAMS / "steps.py"}']
        """)
    cli.run("submit", str(path), "--detach", "--job-id", job, check=True)
    try:
        yield job
    finally:
        cli.run("cancel", job, timeout=60)


@pytest.mark.timeout(240)
def test_watch_names_the_stall_and_what_each_rank_does(cli: Cli, stuck: str) -> None:
    deadline = time.monotonic() + 150
    while not cli.status(stuck).get("diagnosis"):  # the stall watch named it (10-20 s)
        assert time.monotonic() < deadline, cli.status(stuck)
        time.sleep(0.5)
    status = cli.status(stuck)
    assert status["state"] == "RUNNING"
    said = cli.run("status", stuck, check=True).stdout
    terminal = Terminal.orchestrate("status", stuck, "--watch", cwd=cli.work, env=cli.env)
    try:
        text = terminal.wait_for(r"all_reduce #\d+ waiting.*Ctrl-C leaves the view", timeout=60)
        assert "stalled: " in text and "stalled: " in said
        summary = status["diagnosis"]["summary"]
        assert summary[:60] in " ".join(text.split()), text
        assert "waiting for the first steps" not in text
        # Rank 1 stopped in its 8th read, after 7 all_reduces, at least the 10 s the stall
        # watch waited before naming it, although its sidecar still beats every 2.5 s.
        row = re.search(r"^\s*1 +localhost +RUNNING +(.*?) (\d+)s ago", text, flags=re.M)
        assert row is not None, text
        assert "group 0: 7 collectives done" in row.group(1), row.group(0)
        assert int(row.group(2)) >= 10, row.group(0)
        terminal.interrupt()
        assert terminal.wait(timeout=30) == 130
    finally:
        terminal.close()
    assert cli.status(stuck)["state"] == "RUNNING"
