"""A CPU-bandwidth cap for one process: the stand-in for a slow GPU in the mixed-speed tests.

cgroup v1's cpu controller (``cpu.cfs_period_us`` / ``cpu.cfs_quota_us``, what this project's
test machines have) or cgroup v2's ``cpu.max``; a short period (10 ms) so that the capped
process runs in small slices and its speed is even from step to step. :func:`available` says
whether either can be written here (tests skip, saying so, when neither can).

Every such cgroup also gets the highest CPU weight the kernel allows (v1 ``cpu.shares`` 262144,
256 times the default; v2 ``cpu.weight`` 10000, 100 times): the speeds under test are the caps,
not whatever other work on the machine leaves over. On a 2-core box with two CPU-bound processes
beside the suite (``pytest --cpu-load 2``), an unweighted "fast" rank gets about half a core, as
slow as the capped one, and the mixed-speed tests measured the load instead of the shares (ten
times the default weight was still not enough at a load average of 11). A cgroup with no cap
(``cores=None``) is how the fast rank is weighted too. The ranks hold that weight for the minute
a test trains, then the cgroups are removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 10_000
#: The CPU weight of a test cgroup: the kernel's highest (v1 cpu.shares, v2 cpu.weight).
WEIGHT_V1, WEIGHT_V2 = 262_144, 10_000
#: The cap of the mixed-speed tests' slow rank: a third of a core beside a whole one, a 3:1
#: speed (ideal measured / equal epoch 1/2). At half a core (2:1, ideal 2/3) the fixed costs of
#: a step (the all-reduce, which the capped rank does at its capped speed) and other work
#: beside the suite left too little room under the tests' 0.8: 0.70-0.87 under
#: ``--cpu-load 2``, and a CI run failed at 0.814; at a third, 0.56-0.62 there.
SLOW_CORES = 1 / 3


def _root() -> Path | None:
    if (V1 / "cpu.cfs_quota_us").exists() and os.access(V1, os.W_OK):
        return V1
    if (V2 / "cgroup.controllers").exists() and "cpu" in (
            V2 / "cgroup.subtree_control").read_text().split() and os.access(V2, os.W_OK):
        return V2
    return None


#: Held while a mixed-speed measurement runs (:func:`measuring`), machine-wide.
LOCK = Path("/tmp/orchestrate-test-throttle.lock")


@contextlib.contextmanager
def measuring() -> Iterator[None]:
    """One mixed-speed measurement at a time on this machine. Their ranks carry the highest CPU
    weight, so two at once (the local and the SSH test on two pytest-xdist workers) take three
    cores' worth from two: each fast rank got a fraction of a core and the shares moved too
    little (run B: [597, 427] and [635, 389] where a 2:1 speed gives [683, 341])."""
    with open(LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def available() -> str | None:
    """None when a throttle can be made here, else why not."""
    if _root() is not None:
        return None
    return ("neither cgroup v1 cpu.cfs_quota_us (/sys/fs/cgroup/cpu) nor cgroup v2 cpu.max "
            "(with the cpu controller enabled) is writable here")


class Throttle:
    """A cgroup whose members share ``cores`` CPU cores at most (no cap: ``None``), at
    the highest CPU weight; remove it with :meth:`close` once its processes
    are gone (it waits a little for them)."""

    def __init__(self, cores: float | None) -> None:
        root = _root()
        if root is None:
            raise RuntimeError(available())
        self.path = root / f"orchestrate-test-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        quota = -1 if cores is None else int(PERIOD_US * cores)
        if root == V1:
            (self.path / "cpu.shares").write_text(str(WEIGHT_V1))
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.path / "cpu.weight").write_text(str(WEIGHT_V2))
            (self.path / "cpu.max").write_text(f"{'max' if cores is None else quota} {PERIOD_US}")

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the cgroup."""
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def members(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def close(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
