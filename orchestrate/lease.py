"""Leases: which GPUs and master port a running job holds on a host.

Two jobs on one 8-GPU server must get disjoint GPUs and different ports. Each running job
writes a small lease file into a shared directory under an exclusive lock; a planner asks for
the leases first and avoids what they hold. A lease whose holder process is gone is stale and
ignored (and removed), so a crashed controller never blocks the GPUs for ever.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Lease:
    """GPUs and a port on one node, held by one job while ``pid`` lives."""

    job_id: str
    node: str
    gpus: tuple[int, ...]
    port: int | None
    pid: int
    created: float


def holder_alive(pid: int, job_id: str) -> bool:
    """Whether ``pid`` is still the process that took the lease (guards against pid reuse)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust the pid
    return job_id.encode() in cmdline


class LeaseBook:
    """The lease files of one host, in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    @contextmanager
    def locked(self) -> Iterator[list[Lease]]:
        """Hold the book's lock; yields the live leases (stale ones are removed)."""
        with open(self.directory / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield self._live()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _live(self) -> list[Lease]:
        leases = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                data = json.loads(path.read_text())
                lease = Lease(
                    job_id=data["job_id"], node=data["node"], gpus=tuple(data["gpus"]),
                    port=data["port"], pid=data["pid"], created=data["created"],
                )
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if holder_alive(lease.pid, lease.job_id):
                leases.append(lease)
            else:
                path.unlink(missing_ok=True)
        return leases

    def write(self, lease: Lease) -> None:
        """Record a lease (call inside :meth:`locked`)."""
        path = self.directory / f"{lease.job_id}@{lease.node}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(lease)))
        os.replace(tmp, path)

    def release(self, job_id: str) -> None:
        """Drop every lease of ``job_id``."""
        for path in self.directory.glob(f"{job_id}@*.json"):
            path.unlink(missing_ok=True)


def new_lease(job_id: str, node: str, gpus: tuple[int, ...], port: int | None, pid: int) -> Lease:
    """A lease stamped now."""
    return Lease(job_id=job_id, node=node, gpus=gpus, port=port, pid=pid, created=time.time())
