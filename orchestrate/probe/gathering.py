"""Gathering host facts on other machines: the program a transport runs there, and its answer.

``inventory probe`` and ``inventory check`` run :mod:`orchestrate.hostside.hostfacts` on every node.
Over SSH (:mod:`orchestrate.backends.ssh.probe`) and through Slurm
(:mod:`orchestrate.backends.slurm.probe`) the node runs the same command line::

    PYTHON -S -c PROGRAM BOUND_S [--no-torch | --import-torch] PEER...

``PROGRAM`` is :func:`orchestrate.hostside.shipping.program` carrying
``orchestrate.hostside.hostfacts`` (standard library only, Python 3.8+, nothing from site-packages:
``-S``), so nothing has to be installed
on the node but a Python. It is passed as an argument rather than on stdin: one round trip, no
stdin plumbing in either transport (srun hands a task's stdin to task 0 only), and at ~20 kB it
is far below the kernel's 128 kB limit for one argument; it carries nothing secret. ``PEER``\\s
are the other nodes' addresses, so that the route to them names the interface DDP will use.

Both ends are bounded. The node stops itself after ``BOUND_S`` (``SIGALRM``; exit 124): the
gatherer's own steps have timeouts, but a process stuck in the kernel (``nvidia-smi`` on a GPU
that fell off the bus) cannot be killed, and waiting for it would hold the probe for ever. The
controller gives each node its connect timeout plus a little more than ``BOUND_S``.

Pure: argv and text in, values out.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orchestrate.hostside.hostfacts
import orchestrate.hostside.smi
import orchestrate.hostside.smicsv
from orchestrate.hostside.shipping import Manifest, program

#: The program's entry: the bound first, then what ``hostfacts.main`` takes.
ENTRY = """\
import os, signal, sys
args = sys.argv[1:]
bound = int(args.pop(0))
def _expire(signum, frame):
    sys.stderr.write("orchestrate: gathering facts took over %d s on this host\\n" % bound)
    sys.stderr.flush()
    os._exit(124)
signal.signal(signal.SIGALRM, _expire)
signal.alarm(bound)
from orchestrate.hostside.hostfacts import main
sys.exit(main(args))
"""

#: The gatherer: the fact-finding module alone.
GATHERER = Manifest("gatherer", (orchestrate.hostside.smicsv, orchestrate.hostside.smi,
                                  orchestrate.hostside.hostfacts))

#: The interpreter a node runs the probe with unless told otherwise (as the SSH backend).
DEFAULT_PYTHON = "python3"
#: Seconds a node may take to answer once logged in (or once its Slurm task started). The
#: gatherer's own steps stop sooner (nvidia-smi 20 s, torch 120 s): this catches the rest.
DEFAULT_BOUND_S = 150.0
#: Seconds to reach and log into a host over SSH, unless its settings say otherwise.
DEFAULT_CONNECT_TIMEOUT_S = 10.0
#: The exit status of a node that ran out of its bound.
EXIT_EXPIRED = 124
#: How many other nodes each node asks its route to (see :func:`peers_of`).
MAX_PEERS = 8
#: How many of the last lines a failing node printed go into its report.
TAIL_LINES = 4


@dataclass(frozen=True)
class Unreachable:
    """A node that could not be probed, and why (the transport's message)."""

    reason: str


#: What a transport returns per node: the facts dict of ``hostfacts.gather``, or why not.
Gathered = Mapping[str, Any] | Unreachable


def peers_of(addresses: Sequence[str], own: int | None) -> list[str]:
    """The peers node ``own`` (an index into ``addresses``, or None) asks its route to: the
    next :data:`MAX_PEERS` addresses after its own, round the ring. Each route costs the node a
    process (``ip route get``), and a few routes name the interface as well as all of them
    would: so a node's work stays the same at 1000 nodes, and every node is still some
    node's peer. A lone node asks about its own address: the interface holding it."""
    unique = list(dict.fromkeys(addresses))
    if own is None:
        return unique[:MAX_PEERS]
    mine = addresses[own]
    at = unique.index(mine)
    ring = unique[at + 1:] + unique[:at]
    return ring[:MAX_PEERS] or [mine]


def facts_program() -> str:
    """The program each node runs (cached by :func:`orchestrate.hostside.shipping.program`)."""
    return program(GATHERER, ENTRY)


def facts_argv(python: str, peers: Sequence[str], *, bound_s: float, torch: bool = True,
               import_torch: bool = False) -> list[str]:
    """The node's command as argv (srun takes it as is)."""
    flags = ["--no-torch"] if not torch else ["--import-torch"] if import_torch else []
    return [python, "-S", "-c", facts_program(), str(max(1, math.ceil(bound_s))), *flags,
            *peers]


def shell_command(argv: Sequence[str]) -> str:
    """``argv`` as the one command line an SSH server hands to the login shell."""
    return "exec " + " ".join(shlex.quote(word) for word in argv)


def read_facts(output: str) -> dict[str, Any] | None:
    """The facts dict in what a node printed: its last line that is one (a login script may
    print before it, a warning after it)."""
    for line in reversed(output.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and "version" in value and "hostname" in value:
            return value
    return None


def read_split_facts(pieces: Sequence[str]) -> dict[str, Any] | None:
    """The facts dict in output that arrived cut into pieces, each on a line of its own (srun
    ``--label`` cuts a long line where its I/O buffers end and labels every piece): the first
    run of consecutive pieces, starting with ``{``, whose concatenation is the facts."""
    for start, piece in enumerate(pieces):
        if not piece.lstrip().startswith("{"):
            continue
        text = ""
        for part in pieces[start:]:
            text += part
            if not text.rstrip().endswith("}"):
                continue
            found = read_facts(text)
            if found is not None:
                return found
    return None


def failure(python: str, code: int | None, output: str, bound_s: float) -> str:
    """Why a node printed no facts, from its exit status and its last lines."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    tail = " | ".join(lines[-TAIL_LINES:])[-400:]
    said = f": {tail}" if tail else ""
    if code == 127:
        return f"{python} not found on the host{said}"
    if code == EXIT_EXPIRED:
        return (f"gathering facts took over {bound_s:g}s on the host (a hung nvidia-smi?); "
                "raise --timeout if it is only slow")
    if code is None or code < 0:
        return f"{python} was stopped before it answered{said}"
    if code == 0:
        return f"{python} printed no facts{said}"
    return f"{python} -S failed (exit status {code}){said}"

