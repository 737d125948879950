"""Host facts over SSH: one command per host, every host at once, each bounded.

``inventory probe HOST...`` and ``inventory check`` (for nodes reached over SSH) call
:func:`gather_over_ssh`. It uses the SSH backend's connection layer, so host keys, ssh_config,
identities and timeouts follow the same rules as a job's (:mod:`.connections`), and runs in two
steps over all hosts at once (at most ``fanout`` at a time, like pdsh):

1. log in everywhere (bounded by each host's connect timeout). A host that cannot be reached
   or logged into is :class:`~orchestrate.probe.gathering.Unreachable` with the connection layer's
   reason; the others go on;
2. run the facts program (:mod:`orchestrate.probe.gathering`) on every host that answered, with
   addresses some other hosts were reached at as its peers
   (:func:`~orchestrate.probe.gathering.peers_of`), so each host names the interface its route to
   them leaves by. A lone host is given its own address: the interface holding the address it
   was reached at.

A host costs its connect timeout plus its run bound at most, and hosts do not wait for each
other, so 16 hosts take about as long as one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from orchestrate.backends.ssh.connections import ConnectError, Link, Links, Target, fan_out
from orchestrate.probe.gathering import (
    Gathered,
    Unreachable,
    facts_argv,
    failure,
    peers_of,
    read_facts,
    shell_command,
)

#: The controller waits this much longer than a host's own bound (the host stops itself first,
#: and says so; this covers the session opening and a host that cannot even do that).
GRACE_S = 10.0


def gather_over_ssh(
    targets: Sequence[Target],
    *,
    bound_s: float,
    fanout: int = 32,
    torch: bool = True,
    import_torch: bool = False,
) -> dict[str, Gathered]:
    """Facts (or why not) for every target, by target name, in the targets' order."""
    links = Links()
    try:
        opened = fan_out(list(targets), lambda t: links.get(t).open(), fanout)
        gathered: dict[str, Gathered] = {}
        reached: list[Target] = []
        for t in targets:
            result = opened[t.name]
            if result.ok:
                reached.append(t)
            else:
                gathered[t.name] = Unreachable(_reason(result.error))
        seen_at = [links.get(t).peer_ip() or t.address for t in reached]
        index = {t.name: i for i, t in enumerate(reached)}
        answers = fan_out(reached, lambda t: _gather(
            links.get(t), peers_of(seen_at, index[t.name]), bound_s, torch, import_torch),
            fanout)
        for t in reached:
            answer = answers[t.name]
            gathered[t.name] = (answer.value if answer.ok and answer.value is not None
                                else Unreachable(_reason(answer.error)))
        return {t.name: gathered[t.name] for t in targets}
    finally:
        links.close()


def _gather(link: Link, peers: list[str], bound_s: float, torch: bool,
            import_torch: bool) -> Gathered:
    python = link.target.python
    argv = facts_argv(python, peers, bound_s=bound_s, torch=torch, import_torch=import_torch)
    result = link.run(shell_command(argv), timeout=bound_s + GRACE_S)
    facts = read_facts(result.output)
    if facts is None:  # (the program prints its facts last: once they are here, it is done)
        return Unreachable(failure(python, result.code, result.output, bound_s))
    return facts


def _reason(error: Any) -> str:
    if isinstance(error, ConnectError):
        return error.detail
    if isinstance(error, TimeoutError):
        return f"no answer: {error}"
    return f"{type(error).__name__}: {error}"
