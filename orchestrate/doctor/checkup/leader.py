"""The static and connect tiers: what each node's leader (its local rank 0) checks before any
process group exists.

static
    :func:`orchestrate.hostside.hostfacts.gather` on the node, in the rank's own launch context (so
    ``ulimit -l``, /dev/shm and the python are what the job's ranks get), with MASTER_ADDR as the
    peer whose route matters; torch's versions read from its files (no import: a broken torch
    is a fact, not a crash); and the clock offset against node 0 from the roll call.
connect
    the roll call on MASTER_ADDR:MASTER_PORT (:mod:`orchestrate.doctor.checkup.rollcall`), then
    every node connects to every other node's listener on a kernel-chosen ephemeral port (the range
    gloo's pairs and NCCL's sockets listen in, see :mod:`orchestrate.doctor.checkup.reachability`),
    each try bounded by 3 s.

The roll call runs for the static tier too (it carries the clock), but the node-to-node test
only for connect. Nothing is judged here: the leader prints one marked line (``orchestrate-
checkup {"kind": "node", ...}``, :mod:`orchestrate.doctor.checkup.transcript`) and the doctor grades
it against the plan (:mod:`orchestrate.doctor.static_tier`, :mod:`orchestrate.doctor.grading`).
Everything is bounded by the window (plus the gatherer's own command timeouts). Imports no torch.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from orchestrate.doctor.checkup import rollcall, transcript
from orchestrate.doctor.checkup.reachability import Listener, connect_all
from orchestrate.hostside import hostfacts

#: After its own connections, how long a leader keeps listening for the other nodes' (they
#: got the directory at about the same time; each of their tries is bounded by 3 s).
PAIR_GRACE_S = 5.0
#: The gatherer's slowest step is nvidia-smi (20 s bound) or finding torch (120 s bound).
FACTS_BOUND_S = 150.0


def run(
    tiers: Sequence[str],
    *,
    node: str,
    group_rank: int,
    rank: int,
    nodes: int,
    master_addr: str,
    master_port: int,
    window_s: float,
    environ: Mapping[str, str],
) -> dict[str, Any]:
    """Run the node tiers on this leader; returns (and prints) the node's marked report."""
    began = time.monotonic()
    report: dict[str, Any] = {
        "kind": "node", "node": node, "group_rank": group_rank, "rank": rank,
        "host": socket.gethostname(), "tiers": [t for t in tiers if t in ("static", "connect")],
        "master_addr": master_addr, "master_port": master_port,
        "interface": environ.get("GLOO_SOCKET_IFNAME") or None,
    }
    facts: dict[str, Any] = {}
    gatherer = None
    if "static" in tiers:
        def gather() -> None:
            facts.update(hostfacts.gather(peers=[master_addr], torch=True))

        gatherer = threading.Thread(target=gather, name="checkup-facts", daemon=True)
        gatherer.start()

    pair: Listener | None = None
    pair_report: dict[str, Any] = {}
    pair_stop = threading.Event()
    pair_thread = None
    if "connect" in tiers:
        try:
            pair = Listener(0)
        except OSError as exc:
            pair_report["error"] = str(exc)
        if pair is not None:
            listener = pair

            def serve_pairs() -> None:
                pair_report.update(listener.serve(max(0, nodes - 1), window_s + PAIR_GRACE_S + 5,
                                                  pair_stop))

            pair_thread = threading.Thread(target=serve_pairs, name="checkup-pairs", daemon=True)
            pair_thread.start()

    roll_report: dict[str, Any] = {}
    roll_thread = None
    if rank == 0:
        try:
            roll = rollcall.RollCall(master_port)
        except OSError as exc:
            roll_report["error"] = str(exc)
        else:
            def serve_roll() -> None:
                roll_report.update(roll.serve(nodes, window_s))

            roll_thread = threading.Thread(target=serve_roll, name="checkup-rollcall",
                                           daemon=True)
            roll_thread.start()

    hello = {"node": node, "group_rank": group_rank,
             "pair_port": pair.port if pair is not None else None}
    answer = rollcall.answer(master_addr, master_port, hello, window_s)
    directory = answer.pop("directory") or []
    report["rollcall"] = answer
    report["directory"] = directory

    if pair is not None:
        peers = [d for d in directory if d.get("node") != node and d.get("pair_port")]
        results = connect_all([(str(d["address"]), int(d["pair_port"])) for d in peers],
                              hello=node)
        report["pairs"] = [{"target": str(d["node"]), **r}
                           for d, r in zip(peers, results, strict=True)]
        assert pair_thread is not None
        until = time.monotonic() + PAIR_GRACE_S
        while pair_thread.is_alive() and time.monotonic() < until:
            pair_thread.join(0.05)
        pair_stop.set()
        pair_thread.join(2.0)
    if "connect" in tiers:
        report["pair_listener"] = pair_report
    if roll_thread is not None:
        roll_thread.join(max(0.1, began + window_s + 3 - time.monotonic()))
    if rank == 0:
        report["master_listener"] = roll_report
    if gatherer is not None:
        gatherer.join(max(0.1, began + FACTS_BOUND_S - time.monotonic()))
        report["facts"] = dict(facts) if not gatherer.is_alive() else None
        if gatherer.is_alive():
            report["facts_error"] = f"gathering facts took over {FACTS_BOUND_S:.0f} s"
    report["seconds"] = round(time.monotonic() - began, 3)
    report["pid"] = os.getpid()
    transcript.emit(report)
    return report
