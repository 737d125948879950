"""``orchestrate status JOB --watch`` in a real terminal (a tmux pane) on a running job."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.localcli import Cli
from tests.support.reportruns import SLOW_ITEM_S, make_cli, pace_job, reap_all

pytestmark = [pytest.mark.process, pytest.mark.torch]


class Pane:
    """One tmux pane on a private server socket (only this test's server is ever killed)."""

    def __init__(self, socket: str) -> None:
        self.socket = socket

    def tmux(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True,
                              text=True, timeout=20)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def text(self) -> str:
        """Everything the pane shows, scrollback included."""
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "watch")

    def wait_for(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            if re.search(pattern, text, flags=re.S):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"pane never showed {pattern!r}:\n{text}")
            time.sleep(0.3)


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[Cli, Pane]]:
    tmux = shutil.which("tmux")
    assert tmux, "tmux is not installed: run tests/setup.sh (apt-get install tmux)"
    cli = make_cli(tmp_path)
    pane = Pane(f"orchestrate-report-{cli.uid}")
    try:
        yield cli, pane
    finally:
        subprocess.run(["tmux", "-L", pane.socket, "kill-server"], capture_output=True,
                       timeout=20)
        reap_all(cli)


@pytest.mark.timeout(300)
def test_watch_shows_pace_straggler_and_loss_in_place(watched: tuple[Cli, Pane]) -> None:
    cli, pane = watched
    job_id = cli.id("live")
    job = pace_job(cli, "live", SLOW_ITEM_S, epochs=8)
    cli.run("submit", str(job), "--detach", "--job-id", job_id, check=True)

    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(cli.env.items())
                       if k in ("ORCHESTRATE_HOME", "ORCHESTRATE_RUNS", "PYTHONPATH", "PATH"))
    command = (f"cd {shlex.quote(str(cli.work))} && env -u COLUMNS -u LINES {exports} "
               f"{shlex.quote(sys.executable)} "
               f"-m orchestrate status {job_id} --watch; echo WATCH-EXITED $?; sleep 120")
    pane.tmux("new-session", "-d", "-s", "watch", "-x", "150", "-y", "30", command)

    text = pane.wait_for(r"straggler: rank 1 \(localhost\).*loss [▁▂▃▄▅▆▇█]+ ", timeout=150)
    assert "RUNNING" in text
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\s*([01]) +localhost .*$", text,
                                                         flags=re.M)}
    assert set(rows) == {"0", "1"}, text
    assert re.search(r"\+\d+%", rows["1"]), rows["1"]  # rank 1's gap
    # Each rank makes a step every few ms: both last progressed seconds ago, not missing.
    assert re.search(r"\d+s ago", rows["0"]) and re.search(r"\d+s ago", rows["1"]), text
    for column in ("steps/s", "data ms", "compute ms", "sync ms", "progress"):
        assert column in text

    final = pane.wait_for(r"WATCH-EXITED 0", timeout=150)
    assert "COMPLETED" in final
    # Redrawn in place: the table's header is on the screen once, not once per refresh.
    assert final.count("steps/s") == 1, final
    assert cli.status(job_id)["state"] == "COMPLETED"
