"""The local supervisor notices a rank's exit when it happens (orchestrate/backends/local/
supervisor.py ``LocalRank.exit_fd``; orchestrate/run/supervise.py ``_Run.pause``).

What a user would check: a waiting supervisor wakes when the rank's process exits, not at its
next look; the exit it then reads is the rank's, with its last line; and once that exit is
seen the rank offers nothing to wait on (the loop does not spin on a finished rank).
"""

from __future__ import annotations

import select
import time
from pathlib import Path

import pytest

from orchestrate.backends.local.supervisor import LocalRank
from orchestrate.core.plan.outcome import Exit

pytestmark = pytest.mark.process


def test_the_exit_wakes_the_waiter_and_reads_as_the_rank_s(tmp_path: Path) -> None:
    script = tmp_path / "launch-localhost.sh"
    script.write_text("sleep 0.3\necho last words\nexit 3\n")
    lines: list[bytes] = []
    rank = LocalRank(0, "localhost", 0, script, [])
    rank.start(lines.append)
    fd = rank.exit_fd()
    assert fd is not None  # Linux >= 5.3: a pidfd
    assert rank.poll() is None
    started = time.monotonic()
    readable, _, _ = select.select([fd], [], [], 60)  # far longer than the rank lives
    assert readable == [fd] and time.monotonic() - started < 30
    deadline = time.monotonic() + 30
    ended = rank.poll()
    while ended is None and time.monotonic() < deadline:
        ended = rank.poll()
    assert ended == Exit(code=3)
    assert lines == [b"last words\n"]
    assert rank.exit_fd() is None
