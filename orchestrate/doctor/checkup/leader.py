"""The static, health and connect tiers: what each node's leader (its local rank 0) checks
before any process group exists.

static
    :func:`orchestrate.hostside.hostfacts.gather` on the node, in the rank's own launch context (so
    ``ulimit -l``, /dev/shm and the python are what the job's ranks get), with MASTER_ADDR as the
    peer whose route matters; torch's versions read from its files (no import: a broken torch
    is a fact, not a crash); and the clock offset against node 0 from the roll call.
health
    :func:`orchestrate.hostside.gpuhealth.gather` on the node, in a thread beside the static
    facts: the GPUs' health fields and the kernel log's Xid lines (judged by
    :mod:`orchestrate.doctor.health_tier`).
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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from orchestrate.doctor.checkup import rollcall, transcript
from orchestrate.doctor.checkup.reachability import Listener, connect_all
from orchestrate.hostside import gpuhealth, hostfacts

#: After its own connections, how long a leader keeps listening for the other nodes' (they
#: got the directory at about the same time; each of their tries is bounded by 3 s).
PAIR_GRACE_S = 5.0
#: The gatherer's slowest step is nvidia-smi (20 s bound) or finding torch (120 s bound).
FACTS_BOUND_S = 150.0


def _start(name: str, work: Callable[[], Mapping[str, Any]]
           ) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``work`` in a daemon thread; its answer fills the dict once it ends."""
    found: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: found.update(work()), name=name, daemon=True)
    thread.start()
    return thread, found


def _listen_for_pairs(nodes: int, window_s: float, stop: threading.Event
                      ) -> tuple[Listener | None, threading.Thread | None, dict[str, Any]]:
    """connect: this node's listener on a kernel-chosen port, serving the other nodes' hellos
    in the background (or why it could not listen)."""
    try:
        pair = Listener(0)
    except OSError as exc:
        return None, None, {"error": str(exc)}
    thread, served = _start("checkup-pairs", lambda: pair.serve(
        max(0, nodes - 1), window_s + PAIR_GRACE_S + 5, stop))
    return pair, thread, served


def _host_roll_call(master_port: int, nodes: int, names: Sequence[str], window_s: float
                    ) -> tuple[threading.Thread | None, dict[str, Any]]:
    """Node 0: the roll call on MASTER_PORT, in the background (or why it could not listen);
    only the planned nodes (``names``, when the plan names them) are heard."""
    try:
        roll = rollcall.RollCall(master_port)
    except OSError as exc:
        return None, {"error": str(exc)}
    return _start("checkup-rollcall", lambda: roll.serve(nodes, window_s, names))


def _test_pairs(directory: Sequence[Mapping[str, Any]], node: str, serving: threading.Thread,
                stop: threading.Event) -> list[dict[str, Any]]:
    """connect: this node to every other node's listener; then a grace for theirs to reach
    this one's, and the listener stops."""
    peers = [d for d in directory if d.get("node") != node and d.get("pair_port")]
    results = connect_all([(str(d["address"]), int(d["pair_port"])) for d in peers], hello=node)
    until = time.monotonic() + PAIR_GRACE_S
    while serving.is_alive() and time.monotonic() < until:
        serving.join(0.05)
    stop.set()
    serving.join(2.0)
    return [{"target": str(d["node"]), **r} for d, r in zip(peers, results, strict=True)]


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
    names: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the node tiers on this leader; returns (and prints) the node's marked report.
    ``names``: the plan's node names, where the plan chose the hosts (not on Slurm)."""
    began = time.monotonic()
    report: dict[str, Any] = {
        "kind": "node", "node": node, "group_rank": group_rank, "rank": rank,
        "host": socket.gethostname(),
        "tiers": [t for t in tiers if t in ("static", "health", "connect")],
        "master_addr": master_addr, "master_port": master_port,
        "interface": environ.get("GLOO_SOCKET_IFNAME") or None,
    }
    gatherer, facts = _start("checkup-facts", lambda: hostfacts.gather(
        peers=[master_addr], torch=True)) if "static" in tiers else (None, {})
    checker, health = _start("checkup-health", gpuhealth.gather) if "health" in tiers \
        else (None, {})
    stop_pairs = threading.Event()
    pair, serving, served = _listen_for_pairs(nodes, window_s, stop_pairs) \
        if "connect" in tiers else (None, None, {})
    roll, roll_report = _host_roll_call(master_port, nodes, names, window_s) if rank == 0 \
        else (None, {})

    hello = {"node": node, "group_rank": group_rank,
             "pair_port": pair.port if pair is not None else None}
    answer = rollcall.answer(master_addr, master_port, hello, window_s)
    directory = answer.pop("directory") or []
    report["rollcall"] = answer
    report["directory"] = directory
    if serving is not None:
        report["pairs"] = _test_pairs(directory, node, serving, stop_pairs)
    if "connect" in tiers:
        report["pair_listener"] = served
    if roll is not None:
        roll.join(max(0.1, began + window_s + 3 - time.monotonic()))
    if rank == 0:
        report["master_listener"] = roll_report
    if gatherer is not None:
        gatherer.join(max(0.1, began + FACTS_BOUND_S - time.monotonic()))
        report["facts"] = dict(facts) if not gatherer.is_alive() else None
        if gatherer.is_alive():
            report["facts_error"] = f"gathering facts took over {FACTS_BOUND_S:.0f} s"
    if checker is not None:
        checker.join(max(0.1, began + FACTS_BOUND_S - time.monotonic()))
        report["gpu_health"] = dict(health) if not checker.is_alive() else {
            "status": "failed", "error": f"the GPU health check took over {FACTS_BOUND_S:.0f} s"}
    report["seconds"] = round(time.monotonic() - began, 3)
    report["pid"] = os.getpid()
    transcript.emit(report)
    return report
