"""The checkup's marked lines: how its results come back on every backend.

Every backend brings each rank's output back to the controller (``logs/rank-R.log`` in the run
directory: the local supervisor writes it, the SSH supervisor copies it from the pty channel,
Slurm's srun writes it on the shared file system), but files a rank writes elsewhere may stay on
its host (an SSH host has its own copy of the run directory). So what the doctor needs is
printed, each as one line ``orchestrate-checkup {json}``:

- ``{"kind": "node", ...}``: a node leader's static and connect findings
  (:mod:`orchestrate.doctor.checkup.leader`);
- ``{"kind": "result", ...}``: rank 0's result, the shape of ``checkup.json``
  (:class:`orchestrate.doctor.checkup.result.CheckupResult`), printed when it writes it;
- ``{"kind": "rank", ...}``: the same shape from a rank that failed before it could tell rank 0.

:func:`read` finds them in any text: a rank's log, the merged log (``[node:rank]`` prefixes), a
pty's ``\\r\\n`` endings. Pure apart from :func:`emit` (one print).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

MARK = "orchestrate-checkup "


def line(payload: Mapping[str, Any]) -> str:
    """One marked line (no newline)."""
    return MARK + json.dumps(payload, separators=(",", ":"))


def emit(payload: Mapping[str, Any]) -> None:
    """Print one marked line on stdout, flushed (the process may be killed right after)."""
    sys.stdout.write(line(payload) + "\n")
    sys.stdout.flush()


def read(text: str) -> list[dict[str, Any]]:
    """Every marked payload in ``text``, in order; damaged lines (cut short by a kill) are
    skipped."""
    found: list[dict[str, Any]] = []
    for raw in text.splitlines():
        at = raw.find(MARK + "{")
        if at < 0:
            continue
        try:
            value = json.loads(raw[at + len(MARK):].strip())
        except ValueError:
            continue
        if isinstance(value, dict) and isinstance(value.get("kind"), str):
            found.append(value)
    return found
