"""The master's address and port: ports derived per job so that jobs sharing a server do not
collide, unless the job or a backend fixes them; and the addresses a job over several nodes
cannot use (:func:`unreachable_addresses`).

Derived ports fall in [PORT_BASE, PORT_BASE + PORT_SPAN), below Linux's ephemeral range
(32768+), so a derived port never collides with the local port of an outgoing connection.
Pure functions; whether a port is free is asked by the caller (a backend, on the right host).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
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



def is_loopback(address: str) -> bool:
    """Whether ``address`` (as written, not resolved) names a machine's loopback: 127.0.0.0/8,
    ``::1`` or ``localhost``: every machine answers to it as itself."""
    text = address.strip().lower().strip("[]")
    return (text.startswith("127.") or text in ("::1", "localhost", "0:0:0:0:0:0:0:1")
            or text.endswith(".localhost"))


@dataclass(frozen=True)
class UnreachableAddress:
    """An address the job's other nodes cannot reach: which node's (None: the job's own
    ``distributed.master_addr``), and why, as a sentence."""

    node: str | None
    address: str
    message: str
    hint: str


def unreachable_addresses(nodes: Sequence[tuple[str, str]], master_addr: str,
                          addr_fixed: bool) -> list[UnreachableAddress]:
    """For a job over more than one node (``nodes``: name and address, rank 0's first), some
    of them on other machines: a loopback MASTER_ADDR (every node would look for the master on
    itself) and a node written with a loopback address (a node probed with ``inventory probe
    --local`` beside remote ones: its ranks would tell the others to reach them at 127.0.0.1).
    Empty for one node, and for nodes that all say loopback (all this machine: it works)."""
    if len(nodes) < 2 or all(is_loopback(address) for _, address in nodes):
        return []
    found = []
    if addr_fixed and is_loopback(master_addr):
        found.append(UnreachableAddress(
            None, master_addr,
            f"MASTER_ADDR {master_addr} is loopback, and this job spans {len(nodes)} nodes: "
            "the others would look for rank 0 on themselves",
            "give the address the other nodes reach rank 0's node at, or drop "
            "distributed.master_addr (the first node's address is used)"))
    for index, (name, address) in enumerate(nodes):
        if not is_loopback(address):
            continue
        role = ("rank 0's node, so MASTER_ADDR would be loopback: the others would look "
                "for the master on themselves" if index == 0 and not addr_fixed else
                "its ranks would be reached at loopback by the other nodes")
        found.append(UnreachableAddress(
            name, address,
            f"node {name} has the loopback address {address} in a job over {len(nodes)} "
            f"nodes ({role}); a node probed on this machine (inventory probe --local) "
            "cannot be mixed with remote ones",
            f"give node {name} the address the other nodes reach it at (its IP or a name "
            "they resolve), or run the job on one node"))
    return found
