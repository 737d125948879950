"""A rank's program run as the child of a Python helper on the rank's host (the step relay,
:mod:`orchestrate.diagnosis.steprelay`), as if the helper were the program.

The launch script ``exec``\\ s the rank's command, so the supervisor, an SSH agent or srun
signals and waits for the helper, not the program: the helper must pass on every signal that
stops or asks a rank to checkpoint (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2) and end as its
child ended (the same exit code, or killed by the same signal), or the job's ending and restart
decision would read the helper instead of the program. The helper may also stop the child
itself (the NaN stop).

Standard library only, Python 3.8+ (carried into every rank's sidecar folder).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: What a stopped or checkpointing rank is sent; the helper passes each on to its child.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
#: The shell's exit status for a program that cannot be found.
NOT_FOUND = 127


class Child:
    """The program, started with ``env``; the signals in :data:`FORWARDED` reach it."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(argv, env=env)
        for number in FORWARDED:
            signal.signal(number, self._forward)

    def _forward(self, number: int, _frame: Any) -> None:
        if self.process.poll() is None:
            self.process.send_signal(number)

    def poll(self) -> int | None:
        """The child's return code (negative: the signal that killed it), None while it runs."""
        return self.process.poll()

    def stop(self, grace_s: float) -> int:
        """SIGTERM, then SIGKILL after ``grace_s``; returns its return code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                return self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def start(argv: list[str], env: dict[str, str], who: str) -> Child | None:
    """The child, or None when ``argv[0]`` cannot be run (said on stderr as ``who: ...``)."""
    try:
        return Child(argv, env)
    except OSError as exc:
        sys.stderr.write(f"{who}: cannot run {argv[0]} ({exc.strerror or exc})\n")
        return None


def exit_as(returncode: int) -> int:
    """End this process as the child ended: the same exit code, or killed by the same signal
    (an exit code 128 + N where the signal cannot be raised again)."""
    if returncode >= 0:
        return returncode
    number = -returncode
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    except (OSError, ValueError):
        pass
    return 128 + number
