"""How the CLI's own process ends (orchestrate/cli/__init__.py ``entry``, ``leave``).

What a user would check: the exit status is the command's, what was printed reaches the pipe
and ``atexit`` work (temporary files, logging) still runs, though the interpreter is not torn
down; a thread that is not a daemon is still waited for; and the CLI's own ``import`` of
``orchestrate.cli`` loads no click before a submit's supervisor could start.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.corecli import REPO

pytestmark = pytest.mark.process

LEAVES = """
import atexit, sys, threading, time
from orchestrate.cli import leave
atexit.register(lambda: sys.stdout.write(" and atexit ran"))
sys.stdout.write("printed, unflushed")
if sys.argv[1] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.3), sys.stdout.write(" thread done"))).start()
leave(7)
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", LEAVES, *args], capture_output=True,
                          text=True, cwd=REPO, timeout=60, check=False)


def test_leave_keeps_the_status_the_output_and_the_atexit_work() -> None:
    done = _run("plain")
    assert done.returncode == 7, done.stderr
    assert done.stdout == "printed, unflushed and atexit ran"


def test_leave_waits_for_a_thread_that_is_not_a_daemon() -> None:
    done = _run("thread")
    assert done.returncode == 7, done.stderr
    assert "thread done" in done.stdout and "atexit ran" in done.stdout


def test_importing_the_cli_loads_no_click() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sys, orchestrate.cli, orchestrate.backends.early; "
         "print(sorted(m for m in ('click', 'pydantic', 'orchestrate.backends.base') "
         "if m in sys.modules))"], capture_output=True, text=True, cwd=REPO, timeout=60,
        check=False)
    assert done.stdout.strip() == "[]", done.stderr
