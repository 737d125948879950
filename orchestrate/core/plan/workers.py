"""Which worker of a node's launcher failed, from the launcher's own report. Pure.

Under ``launcher: per_node`` or ``torchrun`` a node is one process to orchestrate, recorded under
the node's first rank; its workers are the ranks. When a worker fails, the launcher stops the
node's other workers and exits, saying which one failed:

- ``torch.multiprocessing.spawn`` raises ``ProcessExitedException: process 1 terminated with
  signal SIGKILL`` (or ``... with exit code 3``), or ``ProcessRaisedException`` with ``--
  Process 1 terminated with the following error:`` and the worker's traceback: the number is
  the worker's index on its node, so its rank is the node's first rank plus it (the rank a
  per_node worker joins as, docs/launchers.md);
- torchrun prints its ``Root Cause (first observed failure)``, with the worker's global
  ``rank : 3 (local_rank: 1)`` and ``exitcode : -9`` (a negative code is a signal).

:func:`worker_end` turns the launcher's end into that worker's end, so the job's failure names
the worker (``rank 1 on h2 failed with signal 9 (SIGKILL)``) like any rank. Standard library
only, Python 3.8+: the Slurm monitor bundles this module.
"""

from __future__ import annotations

import re
import signal as signals

from orchestrate.core.plan.outcome import Exit, RankEnd

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

#: How many of the launcher's last output lines are read for its report.
REPORT_LINES = 80

_SPAWN_ENDED = re.compile(
    r"process (\d+) terminated with (?:signal (SIG[A-Z0-9]+)|exit code (-?\d+))")
_SPAWN_RAISED = re.compile(r"-- Process (\d+) terminated with the following error")
_ROOT_CAUSE = "Root Cause (first observed failure)"
_TORCHRUN_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_TORCHRUN_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def worker_end(end: RankEnd, lines: Sequence[str]) -> RankEnd:
    """``end`` of a node's launcher (recorded under its node's first rank) as the end of the
    worker its last output ``lines`` name as failed; ``end`` itself when they name none."""
    if end.exit.ok:
        return end
    found = _torchrun(lines) or _spawn(lines, end.rank)
    if found is None:
        return end
    rank, failed = found
    return RankEnd(rank, end.node, failed, end.at)


def _spawn(lines: Sequence[str], first_rank: int) -> tuple[int, Exit] | None:
    for line in reversed(lines):
        ended = _SPAWN_ENDED.search(line)
        if ended is not None:
            index, name, code = ended.groups()
            if name is not None:
                number = getattr(signals, name, None)
                if number is None:
                    return None
                return first_rank + int(index), Exit(signal=int(number))
            return first_rank + int(index), _exit_code(int(code))
        raised = _SPAWN_RAISED.search(line)
        if raised is not None:  # an exception in the worker: python exits 1
            return first_rank + int(raised.group(1)), Exit(code=1)
    return None


def _torchrun(lines: Sequence[str]) -> tuple[int, Exit] | None:
    try:
        start = max(i for i, line in enumerate(lines) if _ROOT_CAUSE in line)
    except ValueError:
        return None
    rank: int | None = None
    for line in lines[start:]:
        named = _TORCHRUN_RANK.match(line)
        if named is not None:
            rank = int(named.group(1))
            continue
        code = _TORCHRUN_EXIT.match(line)
        if code is not None and rank is not None:
            return rank, _exit_code(int(code.group(1)))
    return None


def _exit_code(code: int) -> Exit:
    """A worker's exit as Python's multiprocessing reports it: negative for a signal."""
    return Exit(signal=-code) if code < 0 else Exit(code=code)
