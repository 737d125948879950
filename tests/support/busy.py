"""Other work beside the suite: ``pytest --cpu-load N`` keeps N CPU-bound processes running for
the whole session, the busy machine a test must pass on.

A test that fails because the machine is slow is a flaky test, and "slow" is the normal state of
a 2-core CI box with other work on it. The tests that assert a speed, a ratio or a deadline carry
the ``timing`` mark; ``python3 -m pytest -m timing --cpu-load 2`` is how they are proved robust
(docs/performance.md, "The test suite's time"). The burners are plain ``while True`` loops in
their own process group at the default priority and CPU weight, as another user's work would
be: neither niced (that would hide the load) nor favoured. Each burner ends by itself when the
pytest that started it is gone (its parent changes), so a run killed without its cleanup (SIGTERM,
SIGKILL, a lost terminal) leaves no load behind for whatever runs next: two such orphans once
burned beside four later runs for 90 minutes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

# The starter's pid is written in, not read by the burner: a starter killed before the burner's
# interpreter is up would otherwise leave a burner whose "parent" is already init.
_BURN = "import os\nwhile os.getppid() == {parent}:\n    for _ in range(1000000):\n        pass\n"


class Burners:
    """``count`` CPU-bound processes until :meth:`stop`."""

    def __init__(self, count: int) -> None:
        burn = _BURN.format(parent=os.getpid())
        self.procs = [subprocess.Popen([sys.executable, "-c", burn], start_new_session=True,
                                       stdin=subprocess.DEVNULL) for _ in range(count)]

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def add_option(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-load", type=int, default=0, metavar="N",
                     help="keep N CPU-bound processes running beside the tests (a busy "
                          "machine; tests/support/busy.py)")


def start(config: pytest.Config) -> None:
    """Start the session's burners, if ``--cpu-load`` asks for any; stopped at exit. Under
    pytest-xdist only the controller starts them (each worker configures itself too)."""
    count = int(config.getoption("--cpu-load"))
    if count <= 0 or hasattr(config, "workerinput"):
        return
    burners = Burners(count)
    config.add_cleanup(burners.stop)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"--cpu-load: {count} CPU-bound processes beside the tests "
                            f"(pids {', '.join(str(p.pid) for p in burners.procs)})")
