"""The master's address and port: ports derived per job so that jobs sharing a server do not
collide, unless the job or a backend fixes them.

Derived ports fall in [PORT_BASE, PORT_BASE + PORT_SPAN), below Linux's ephemeral range
(32768+), so a derived port never collides with the local port of an outgoing connection.
Pure functions; whether a port is free is asked by the caller (a backend, on the right host).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrate.core.spec.job import JobSpec

PORT_BASE = 20000
PORT_SPAN = 12000


def derive_port(job_id: str) -> int:
    """A master port that is stable for a job id and spread over the range."""
    digest = hashlib.sha256(job_id.encode()).digest()
    return PORT_BASE + int.from_bytes(digest[:4], "big") % PORT_SPAN


def pick_port(
    preferred: int, taken: Collection[int], is_free: Callable[[int], bool]
) -> int | None:
    """``preferred`` if it is free, else the next free port of the range (wrapping); None if
    the whole range is taken."""
    candidates = [preferred] + [
        PORT_BASE + (preferred - PORT_BASE + step) % PORT_SPAN for step in range(1, PORT_SPAN)
    ]
    for port in candidates:
        if port not in taken and is_free(port):
            return port
    return None


def master_endpoint(
    job: JobSpec, first_address: str, job_id: str, found_port: int | None
) -> tuple[str, int, bool, bool]:
    """MASTER_ADDR, MASTER_PORT, and whether each was fixed by the job (not derived): the first
    node's address and the derived port, unless the job (``distributed.master_addr`` and
    ``master_port``) or a backend (``found_port``, free on the master host) says otherwise."""
    port_fixed = isinstance(job.distributed.master_port, int)
    if found_port is not None:
        port = found_port
    elif isinstance(job.distributed.master_port, int):
        port = job.distributed.master_port
    else:
        port = derive_port(job_id)
    addr = job.distributed.master_addr or first_address
    addr_fixed = job.distributed.master_addr is not None
    return addr, port, addr_fixed, port_fixed

