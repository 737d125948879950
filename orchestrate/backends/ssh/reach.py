"""Before launch, every node reaches the master: the last check of preflight, on the channels
preflight opened.

Preflight's answers say that MASTER_ADDR resolves on every node; this step says that its port
answers from every node. Rank 0's node holds a probe listener on the planned master port
(:mod:`orchestrate.hostside.masterreach`), every other node connects to MASTER_ADDR:port, and
rank 0's node closes the listener before the controller goes on: its channel carries
``unlisten`` before ``start``, so the probe never holds the port when rank 0's store binds it.
A node that cannot connect is named with the cause (refused, no answer, does not resolve) and
nothing starts, instead of every rank waiting in the rendezvous until its timeout.

A job on one node skips it: its ranks reach the store on their own machine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from orchestrate.backends.ssh.channels import AgentChannel
from orchestrate.backends.ssh.connections import Target, fan_out
from orchestrate.backends.ssh.wire import Listen, Reach, Unlisten
from orchestrate.core.plan.plan import Plan
from orchestrate.hostside.masterreach import REACH_TIMEOUT_S

#: The controller waits this much longer than a node's own connect bound.
GRACE_S = 10.0

#: A failed check: (host, check, why), as :class:`~.preflight.Judgement` keeps them.
Failure = tuple[Target, str, str]


def reach_master(plan: Plan, channels: Mapping[str, AgentChannel],
                 targets: Mapping[str, Target], fanout: int) -> list[Failure]:
    """Whether every other node of ``plan`` reaches MASTER_ADDR:MASTER_PORT (``channels``:
    each node's first agent channel); the failures, empty when all do."""
    if len(plan.nodes) < 2:
        return []
    master = plan.nodes[0]
    port = plan.master_port
    bound = REACH_TIMEOUT_S + GRACE_S
    probe = channels[master.name]
    try:
        listening = probe.request(Listen(port), "listen", bound)
    except Exception as exc:  # an agent that does not know the step: say so, start nothing
        return [(targets[master.name], "master", f"cannot hold a probe on port {port}: {exc}")]
    if not listening.get("ok"):
        return [(targets[master.name], "master", str(listening.get("detail")))]
    try:
        others = [targets[n.name] for n in plan.nodes[1:]]
        answers = fan_out(others, _asker(channels, plan.master_addr, port, bound), fanout)
    finally:
        probe.request(Unlisten(), "unlisten", bound)
    failures: list[Failure] = []
    for target in others:
        answer = answers[target.name]
        reply: dict[str, Any] = answer.value or {}
        if answer.error is not None:
            failures.append((target, "master", f"the check did not answer: {answer.error}"))
        elif not reply.get("ok"):
            failures.append((target, "master", f"{reply.get('detail')} (rank 0 runs on "
                                               f"{master.name})"))
    return failures


def _asker(channels: Mapping[str, AgentChannel], address: str, port: int, bound: float
           ) -> Callable[[Target], dict[str, Any]]:
    def ask(target: Target) -> dict[str, Any]:
        return channels[target.name].request(Reach(address, port), "reach", bound)
    return ask
