"""The watchdog beside a local supervisor: when the supervisor ends, however it ends (even by
SIGKILL), stop whatever its job left on this machine and let go of the job's lease.

Started by :func:`orchestrate.backends.detached.start_watchdog` as ``python -S -c <program>``
(:data:`orchestrate.backends.detached.WATCHDOG`): standard library only, Python
3.8+, a few megabytes. It is one of the lease's holders, so the lease stays held while it stops
the ranks; it finds them by tag and, where the job has a cgroup (named in the lease), by
membership. What survives SIGKILL keeps the lease held (:mod:`orchestrate.hostside.leases`).
"""

from __future__ import annotations

import os
import time

from orchestrate.hostside.containment import JobGroup, describe_pid, stop_processes
from orchestrate.hostside.host import alive, reap
from orchestrate.hostside.leases import BookError, LeaseBook

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def watch(pid: int, start: int | None, job_id: str, grace_s: float, poll_s: float = 0.25,
          lease_root: str | None = None, containers: bool = True) -> int:
    """Wait for process ``pid`` (started at ``start``) to end, then stop whatever the job left
    here (its containers too, unless it runs in none) and leave its lease (dropped once nothing
    of the job lives). Returns the number of processes it stopped."""
    while alive(pid, start):
        time.sleep(poll_s)
    return int(stop_job(job_id, grace_s, lease_root, [pid, os.getpid()],
                        containers=containers)["found"])


def stop_job(job_id: str, grace_s: float, lease_root: str | None = None,
             gone: list[int] | None = None, containers: bool = True) -> dict[str, Any]:
    """Stop every process of this user's job here -- by tag, and by the cgroup its lease names
    -- then let go of its lease on behalf of ``gone`` (holders that ended): the lease is dropped
    unless something of the job survived SIGKILL. What the SSH agent's ``reap`` and the local
    backend's ``cancel`` without a supervisor run too."""
    result: dict[str, Any] = dict(reap(job_id, grace_s, containers))
    survivors: list[int] = []
    try:
        book = LeaseBook(lease_root)
    except (BookError, OSError) as exc:
        result["lease_error"] = str(exc)
        return result
    lease = book.own(job_id)
    path = lease.cgroup if lease is not None else None
    if path:
        group = JobGroup(path, os.path.dirname(path))
        me = {os.getpid()}
        survivors = stop_processes(lambda: group.members(me), grace_s)
        result["found"] += len(survivors)
        group.remove()
    holders = [p for p, _ in lease.holders] if gone is None and lease is not None \
        else gone or []
    try:
        book.leave(job_id, holders, survivors,
                   [f"{describe_pid(p)} outlived the job" for p in survivors])
    except (BookError, OSError) as exc:
        result["lease_error"] = str(exc)
    result["survivors"] = [describe_pid(p) for p in survivors]
    return result


__all__ = ["stop_job", "watch"]
