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

:func:`ssh_reach` builds the targets of ``inventory probe HOST...`` / ``--from FILE``: the
command line's ssh settings over the file's (its node's, else its defaults), and what the
written inventory keeps of how each host was reached; :func:`node_targets` those of an
inventory's nodes, as ``inventory check`` reaches them.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrate.backends.ssh.connections import (
    ConnectError,
    Link,
    Links,
    Target,
    fan_out,
    target,
)
from orchestrate.core.errors import UserError
from orchestrate.core.spec import hostlist
from orchestrate.core.spec.inventory import (
    Inventory,
    Node,
    NodeSpec,
    SSHSpec,
    load_inventory_spec,
    resolve_inventory,
)
from orchestrate.probe.gathering import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_PYTHON,
    Gathered,
    Unreachable,
    facts_argv,
    failure,
    peers_of,
    read_facts,
    shell_command,
)
from orchestrate.run.extras import require
from orchestrate.run.progress import HostCount

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
    addresses: dict[str, str] | None = None,
) -> dict[str, Gathered]:
    """Facts (or why not) for every target, by target name, in the targets' order; into
    ``addresses``, for each host reached whose name would not take another machine there, the
    address that does (:func:`address_to_write`)."""
    require("ssh", "reaching hosts over SSH")  # not one ModuleNotFoundError per host
    links = Links()
    try:
        logins = HostCount("logging in", [t.name for t in targets])
        opened = fan_out(list(targets), logins.counted(_name, lambda t: links.get(t).open()),
                         fanout)
        gathered: dict[str, Gathered] = {}
        reached: list[Target] = []
        for t in targets:
            result = opened[t.name]
            if result.ok:
                reached.append(t)
            else:
                gathered[t.name] = Unreachable(_reason(result.error))
        seen_at = [links.get(t).peer_ip() or t.address for t in reached]
        if addresses is not None:
            for t in reached:
                found = address_to_write(t.name, links.get(t).host(), links.get(t).peer_ip())
                if found is not None:
                    addresses[t.name] = found
        index = {t.name: i for i, t in enumerate(reached)}
        facts = HostCount("gathering facts", [t.name for t in reached])
        answers = fan_out(reached, facts.counted(_name, lambda t: _gather(
            links.get(t), peers_of(seen_at, index[t.name]), bound_s, torch, import_torch)),
            fanout)
        for t in reached:
            answer = answers[t.name]
            gathered[t.name] = (answer.value if answer.ok and answer.value is not None
                                else Unreachable(_reason(answer.error)))
        return {t.name: gathered[t.name] for t in targets}
    finally:
        links.close()


def _name(target: Target) -> str:
    return target.name


def address_to_write(name: str, host: str | None, peer_ip: str | None) -> str | None:
    """The ``address:`` a probed node needs, or None when its name will do: a name that does
    not resolve here (an ssh_config alias) gets ssh_config's HostName, else the IP it was
    reached at; a name that resolves elsewhere than where the connection went gets HostName
    too. MASTER_ADDR is the first node's address, and every node must resolve it."""
    reached = host if host and host != name else peer_ip
    try:
        resolved = {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
    except (OSError, UnicodeError):
        return reached
    resolved |= {ip.removeprefix("::ffff:") for ip in resolved}
    if peer_ip is not None:  # the name goes where the connection went: it will do
        return None if peer_ip in resolved else reached
    return None if host is None or host == name or host in resolved else host


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


# ------------------------------------------------------------------------------- targets

_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")


@dataclass(frozen=True)
class SshReach:
    """How to reach each host to probe, and what the written inventory keeps of it."""

    targets: list[Target]
    addresses: dict[str, str]  # node -> address, where it is not the node's name
    extras: dict[str, dict[str, Any]]  # node -> its own ssh/python/slurm (from --from)
    defaults: dict[str, Any]  # the written file's defaults: ssh settings, python, slurm


@dataclass(frozen=True)
class _Source:
    """The ``--from`` inventory: its nodes, each node's own entry, and its defaults."""

    inv: Inventory | None = None
    entries: dict[str, NodeSpec] = field(default_factory=dict)
    ssh: dict[str, Any] = field(default_factory=dict)
    python: str | None = None
    slurm: dict[str, Any] | None = None


def _source(from_file: Path | None) -> _Source:
    if from_file is None:
        return _Source()
    spec, lines = load_inventory_spec(from_file)
    d = spec.defaults
    return _Source(
        inv=resolve_inventory(spec, str(from_file), lines),
        entries={name: entry for entry in spec.nodes for name in hostlist.expand(entry.name)},
        ssh=d.ssh.model_dump(exclude_unset=True) if d.ssh is not None else {},
        python=d.python,
        slurm=d.slurm.model_dump(exclude_unset=True) if d.slurm is not None else None,
    )


def _own_settings(entry: NodeSpec, settings: Mapping[str, Any]) -> dict[str, Any]:
    """What the written file keeps of a ``--from`` node's own entry: its ssh (under the
    command line's settings), python and slurm."""
    extra: dict[str, Any] = {}
    if entry.ssh is not None:
        extra["ssh"] = {**entry.ssh.model_dump(exclude_unset=True), **settings}
    if entry.python is not None:
        extra["python"] = entry.python
    if entry.slurm is not None:
        extra["slurm"] = entry.slurm.model_dump(exclude_unset=True)
    return extra


def ssh_reach(hosts: Sequence[str], from_file: Path | None, settings: Mapping[str, Any],
              python: str | None) -> SshReach:
    """Targets for ``hosts`` (hostlists expanded) from the command line's ssh ``settings`` over
    ``from_file``'s (per node where it has the node, else its defaults). With ``from_file`` and
    no hosts: all its nodes."""
    names = host_names(hosts)
    src = _source(from_file)
    names = names or ([n.name for n in src.inv.nodes] if src.inv else [])
    timeout = float(settings.get("connect_timeout_s") or DEFAULT_CONNECT_TIMEOUT_S)
    targets, addresses, extras = [], {}, {}
    for name in names:
        node = src.inv.node(name) if src.inv is not None else None
        if node is None:
            targets.append(target(name, name, python or src.python or DEFAULT_PYTHON,
                                  SSHSpec(**{**src.ssh, **settings}), timeout))
            continue
        extras[name] = _own_settings(src.entries[name], settings)
        if node.address != name:
            addresses[name] = node.address
        ssh = SSHSpec(**{**node.ssh.model_dump(exclude_unset=True), **settings})
        targets.append(target(name, node.address, python or node.python or DEFAULT_PYTHON,
                              ssh, timeout))
    defaults: dict[str, Any] = {}
    if {**src.ssh, **settings}:
        defaults["ssh"] = {**src.ssh, **settings}
    if python or src.python:
        defaults["python"] = python or src.python
    if src.slurm is not None:
        defaults["slurm"] = src.slurm
    return SshReach(targets, addresses, extras, defaults)


def host_names(hosts: Sequence[str]) -> list[str]:
    """HOST arguments as node names: hostlists expanded, duplicates dropped."""
    names: list[str] = []
    for host in hosts:
        if "@" in host:
            raise UserError.single("a HOST is a host name or address", source="command line",
                                   got=host, hint="give the user with --user")
        try:
            expanded = hostlist.expand(host)
        except ValueError as exc:
            raise UserError.single(f"not a hostlist: {exc}", source="command line",
                                   got=host) from None
        for name in expanded:
            if not _HOST.match(name):
                raise UserError.single(
                    "not a host name or IPv4 address (it becomes the node's name)",
                    source="command line", got=name,
                    hint="name the host in an ssh_config (Host/HostName) and probe that name",
                )
            if name not in names:
                names.append(name)
    return names


def node_targets(nodes: Sequence[Node]) -> list[Target]:
    """How ``inventory check`` reaches inventory nodes over SSH: each node's address, ssh
    settings and python."""
    return [target(n.name, n.address, n.python or DEFAULT_PYTHON, n.ssh,
                   DEFAULT_CONNECT_TIMEOUT_S) for n in nodes]


@dataclass(frozen=True)
class AgentAnswer:
    """One node's answer to an agent question (``gpus``, ``queue``): the JSON it printed, or
    why there is none (``value`` None)."""

    node: str
    host: str
    value: dict[str, Any] | None
    why: str = ""


def ask_agents(nodes: Sequence[Node], question: str) -> list[AgentAnswer]:
    """Ask every node's agent one question (``agent QUESTION LEASE_DIR``) over SSH, all at once,
    each bounded by its connect timeout plus the usual slack; in inventory order. A node that
    cannot be reached, or whose agent does not answer, gets the reason instead of a hang."""
    from orchestrate.backends.ssh.agent import MARK
    from orchestrate.backends.ssh.channels import agent_command
    from orchestrate.backends.ssh.reaping import SLACK_S, describe_failure

    targets = [target(n.name, n.address, n.python or DEFAULT_PYTHON, n.ssh,
                      DEFAULT_CONNECT_TIMEOUT_S, n.lease_dir) for n in nodes]
    links = Links()
    mark = f"{MARK}{question} "

    def ask(t: Target) -> dict[str, Any]:
        result = links.get(t).run(agent_command(t.python, question, t.lease_dir or ""),
                                  timeout=t.connect_timeout_s + SLACK_S)
        for line in result.output.split("\n"):  # not splitlines(): it splits at MARK's \x1e
            if line.startswith(mark):
                data: dict[str, Any] = json.loads(line[len(mark):])
                return data
        tail = " | ".join(result.output.strip().split("\n")[-3:])
        raise RuntimeError(f"the agent did not answer (exit {result.code}): {tail}")

    try:
        answers = fan_out(targets, ask, 32)
    finally:
        links.close()
    told = []
    for t in targets:
        got = answers[t.name]
        if got.value is not None:
            told.append(AgentAnswer(t.name, t.label, got.value))
            continue
        error = got.error if isinstance(got.error, Exception) else RuntimeError(got.error)
        told.append(AgentAnswer(t.name, t.label, None, describe_failure(error)))
    return told
