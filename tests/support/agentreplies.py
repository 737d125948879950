"""The SSH agent's replies as a test reads them from its standard output: one reader for every
test that runs the agent's program (``python -S -c SOURCE serve``) directly."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from orchestrate.backends.ssh.agent import MARK


def agent_replies(proc: subprocess.CompletedProcess[str]) -> list[tuple[str, Any]]:
    """``(kind, payload)`` for each line the agent marked as a reply; fails the test, with its
    exit status and standard error, when it said nothing."""
    replies: list[tuple[str, Any]] = []
    for line in proc.stdout.split("\n"):  # not splitlines(): MARK starts with \x1e
        if line.startswith(MARK):
            kind, _, payload = line[len(MARK):].partition(" ")
            replies.append((kind, json.loads(payload)))
    assert replies, f"the agent said nothing (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return replies
