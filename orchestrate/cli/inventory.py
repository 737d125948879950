"""``orchestrate inventory``: show an inventory, write one from the machines, check for drift.

``probe`` and ``check`` are built in two halves so that each transport only has to gather:

- gathering runs :func:`orchestrate.hostside.hostfacts.gather` on every node and returns a mapping
of
  node name -> raw facts dict, or :class:`~orchestrate.probe.gathering.Unreachable` for a node that
  could not be probed. This machine (``--local``; inventory nodes at 127.0.0.1/localhost) is
  gathered in this process; hosts over SSH (``probe HOST...``, ``--from``) by
  :mod:`orchestrate.backends.ssh.probe`; a Slurm cluster's nodes (``--slurm``) by
  :mod:`orchestrate.backends.slurm.probe`. ``check`` reaches each node the way its file says;
- :func:`write_probed` and :func:`check_gathered` do everything after that: parse, fold,
  merge, diff, ask, write, report, and choose the exit status (0 all matched / written,
  1 drift or a node that could not be probed, 2 a user error).
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from orchestrate.cli.tables import console, inventory_table
from orchestrate.core.errors import UserError
from orchestrate.core.spec import hostlist
from orchestrate.core.spec.inventory import (
    Inventory,
    InventorySpec,
    Node,
    load_inventory,
    resolve_inventory,
)
from orchestrate.core.spec.loader import parse_yaml, validate
from orchestrate.hostside import hostfacts
from orchestrate.probe.drift import drift
from orchestrate.probe.facts import HostFacts, parse_facts
from orchestrate.probe.gathering import Gathered, Unreachable
from orchestrate.probe.inventoryfile import (
    ProbedNode,
    merge_inventory,
    provenance_of,
    render_inventory,
    unified_diff,
)

if TYPE_CHECKING:
    from orchestrate.backends.ssh.connections import Target

__all__ = ["Gathered", "Unreachable", "check_gathered", "gather_for_check", "gather_local",
           "write_probed"]

#: The node name and address ``--local`` writes (the same as the local backend's machine).
LOCAL_NAME, LOCAL_ADDRESS = "localhost", "127.0.0.1"
EXIT_DRIFT = 1


@click.group()
def inventory() -> None:
    """Inspect inventory files, write them from the machines, check them for drift."""


@inventory.command("show")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def inventory_show(file: Path, as_json: bool) -> None:
    """Nodes, their GPUs (CUDA index in PCI bus order), links and networks."""
    inv = load_inventory(file)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "name": inv.name,
                    "nodes": [
                        {
                            "name": n.name,
                            "address": n.address,
                            "gpus": [
                                {"index": g.index, "model": g.model, "memory_gb": g.memory_gb}
                                for g in n.gpus
                            ],
                            "slots": n.slots,
                            "gpu_link": n.gpu_link,
                            "network": None
                            if n.network is None
                            else n.network.model_dump(mode="json"),
                            "partition": n.partition,
                        }
                        for n in inv.nodes
                    ],
                },
                indent=2,
            )
        )
        return
    console().print(inventory_table(inv))


# ------------------------------------------------------------------------------------ probe

#: The interpreter a node runs the probe with unless told otherwise (as the SSH backend).
DEFAULT_PYTHON = "python3"
#: Seconds a node may take to answer once logged in (or once its Slurm task started). The
#: gatherer's own steps stop sooner (nvidia-smi 20 s, torch 120 s): this catches the rest.
DEFAULT_BOUND_S = 150.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
_SSH_FLAGS = ("ssh_config", "user", "port", "identity", "known_hosts", "accept_unknown_host_keys",
              "connect_timeout", "fanout")
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")


@inventory.command("probe")
@click.argument("hosts", nargs=-1, metavar="[HOST]...")
@click.option("--local", "local", is_flag=True, help="probe this machine")
@click.option("--slurm", "use_slurm", is_flag=True,
              help="probe the Slurm cluster's nodes (scontrol, then one srun task per node)")
@click.option("--partition", default=None,
              help="with --slurm: only this partition's nodes (written as their partition)")
@click.option("--nodes", "node_list", default=None,
              help="with --slurm: only these nodes (a hostlist, e.g. 'gpu[01-16]')")
@click.option("--from", "from_file", type=click.Path(path_type=Path), default=None,
              help="reach the hosts with this inventory's ssh settings and python "
                   "(no HOST: all its nodes)")
@click.option("--ssh-config", type=click.Path(path_type=Path), default=None,
              help="an ssh_config to read instead of ~/.ssh/config")
@click.option("--user", default=None, help="log in as this user")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="sshd's port")
@click.option("--identity", type=click.Path(path_type=Path), default=None,
              help="the private key to log in with (else ssh_config's, or the agent's)")
@click.option("--known-hosts", type=click.Path(path_type=Path), default=None,
              help="the known_hosts file host keys are checked against")
@click.option("--accept-unknown-host-keys", is_flag=True, default=False,
              help="trust a host key seen for the first time (never saved); a changed one "
                   "is still refused")
@click.option("--connect-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help=f"seconds to reach and log into a host (default "
                   f"{DEFAULT_CONNECT_TIMEOUT_S:g})")
@click.option("--fanout", type=click.IntRange(min=1), default=32,
              help="hosts logged into at once")
@click.option("--python", "python", default=None,
              help=f"the interpreter on the nodes (default {DEFAULT_PYTHON}, or --from's)")
@click.option("--timeout", "bound_s", type=click.FloatRange(min=1), default=DEFAULT_BOUND_S,
              help="seconds a node may take to answer once logged in (or its task started; "
                   f"default {DEFAULT_BOUND_S:g})")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="write (or update) this inventory file instead of printing it")
@click.option("--yes", is_flag=True, help="overwrite without asking (the diff is still shown)")
@click.option("--name", "inventory_name", default=None,
              help="the inventory's name (default: the output file's stem)")
@click.option("--no-torch", is_flag=True, help="do not look for torch on the nodes")
@click.option("--import-torch", is_flag=True,
              help="import torch on each node to prove it loads (seconds per node)")
def inventory_probe(hosts: tuple[str, ...], local: bool, use_slurm: bool,
                    partition: str | None, node_list: str | None, from_file: Path | None,
                    ssh_config: Path | None, user: str | None, port: int | None,
                    identity: Path | None, known_hosts: Path | None,
                    accept_unknown_host_keys: bool, connect_timeout: float | None,
                    fanout: int, python: str | None, bound_s: float, output: Path | None,
                    yes: bool, inventory_name: str | None, no_torch: bool,
                    import_torch: bool) -> int:
    """Write an inventory from what the machines say: GPUs by model in CUDA order, their link,
    the network, CPUs. HOST... are probed over SSH (hostlists such as 'gpu[01-16]' expand);
    --slurm probes a Slurm cluster's nodes; --local this machine. Over an existing file, only
    probed fields change (a diff is shown)."""
    context = click.get_current_context()
    ssh_mode = bool(hosts) or from_file is not None
    modes = [m for m, on in (("HOST/--from", ssh_mode), ("--local", local),
                             ("--slurm", use_slurm)) if on]
    if len(modes) != 1:
        raise UserError.single(
            "say which machines to probe" if not modes
            else f"probe one kind of machine at once, not {' and '.join(modes)}",
            source="command line",
            hint="HOST... (or --from FILE) over SSH, --slurm for a Slurm cluster's nodes, "
                 "--local for this machine",
        )
    ssh_flags = [f"--{k.replace('_', '-')}" for k in _SSH_FLAGS
                 if context.get_parameter_source(k) is ParameterSource.COMMANDLINE]
    if ssh_flags and not ssh_mode:
        raise UserError.single(f"SSH settings apply to probing over SSH only: "
                               f"{' '.join(ssh_flags)}", source="command line",
                               hint="give HOST... (or --from FILE) to probe over SSH")
    if (partition or node_list) and not use_slurm:
        raise UserError.single("--partition and --nodes choose Slurm nodes",
                               source="command line", hint="add --slurm")
    if python is not None and local:
        raise UserError.single("--local probes with this interpreter", source="command line",
                               field="--python", got=python)
    torch = not no_torch
    name = inventory_name or (output.stem if output is not None else None)
    if local:
        gathered: dict[str, Gathered] = {
            LOCAL_NAME: gather_local(torch=torch, import_torch=import_torch)
        }
        return write_probed(gathered, output=output, yes=yes, inventory_name=name or "local",
                            addresses={LOCAL_NAME: LOCAL_ADDRESS})
    if use_slurm:
        return _probe_slurm(partition, node_list, python, bound_s, torch, import_torch,
                            output=output, yes=yes, name=name or "slurm")
    settings = {
        "config_file": _path(ssh_config), "user": user, "port": port,
        "identity_file": _path(identity), "known_hosts_file": _path(known_hosts),
        "accept_unknown_host_keys": accept_unknown_host_keys or None,
        "connect_timeout_s": connect_timeout,
    }
    reach = ssh_reach(hosts, from_file, {k: v for k, v in settings.items() if v is not None},
                      python)
    from orchestrate.backends.ssh.probe import gather_over_ssh

    gathered = dict(gather_over_ssh(reach.targets, bound_s=bound_s, fanout=fanout, torch=torch,
                                    import_torch=import_torch))
    return write_probed(gathered, output=output, yes=yes, inventory_name=name or "hosts",
                        addresses=reach.addresses, extras=reach.extras,
                        defaults=reach.defaults)


def _path(path: Path | None) -> str | None:
    """A file named on the command line, absolute (it is written into the inventory, which may
    be used from elsewhere); ``~`` is kept for the reader to expand."""
    if path is None:
        return None
    text = str(path)
    return text if text.startswith("~") else os.path.abspath(text)


@dataclass(frozen=True)
class SshReach:
    """How to reach each host to probe, and what the written inventory keeps of it."""

    targets: list[Target]
    addresses: dict[str, str]  # node -> address, where it is not the node's name
    extras: dict[str, dict[str, Any]]  # node -> its own ssh/python (from --from)
    defaults: dict[str, Any]  # the written file's defaults: ssh settings, python


def ssh_reach(hosts: Sequence[str], from_file: Path | None, settings: Mapping[str, Any],
              python: str | None) -> SshReach:
    """Targets for ``hosts`` (hostlists expanded) from the command line's ssh ``settings`` over
    ``from_file``'s (per node where it has the node, else its defaults). With ``from_file`` and
    no hosts: all its nodes."""
    from orchestrate.backends.ssh.connections import target
    from orchestrate.core.spec.inventory import SSHSpec, load_inventory_spec

    names = _host_names(hosts)
    base_ssh: dict[str, Any] = {}
    base_python: str | None = None
    base_slurm: dict[str, Any] | None = None
    specs: dict[str, Any] = {}
    inv: Inventory | None = None
    if from_file is not None:
        spec, lines = load_inventory_spec(from_file)
        inv = resolve_inventory(spec, str(from_file), lines)
        if spec.defaults.ssh is not None:
            base_ssh = spec.defaults.ssh.model_dump(exclude_unset=True)
        base_python = spec.defaults.python
        if spec.defaults.slurm is not None:
            base_slurm = spec.defaults.slurm.model_dump(exclude_unset=True)
        for entry in spec.nodes:
            for node_name in hostlist.expand(entry.name):
                specs[node_name] = entry
        names = names or [n.name for n in inv.nodes]
    timeout = float(settings.get("connect_timeout_s") or DEFAULT_CONNECT_TIMEOUT_S)
    targets, addresses, extras = [], {}, {}
    for node_name in names:
        node = inv.node(node_name) if inv is not None else None
        if node is not None:
            ssh = SSHSpec(**{**node.ssh.model_dump(exclude_unset=True), **settings})
            own = specs[node_name]
            extra: dict[str, Any] = {}
            if own.ssh is not None:
                extra["ssh"] = {**own.ssh.model_dump(exclude_unset=True), **settings}
            if own.python is not None:
                extra["python"] = own.python
            if own.slurm is not None:
                extra["slurm"] = own.slurm.model_dump(exclude_unset=True)
            extras[node_name] = extra
            if node.address != node_name:
                addresses[node_name] = node.address
            targets.append(target(node_name, node.address,
                                  python or node.python or DEFAULT_PYTHON, ssh, timeout))
        else:
            ssh = SSHSpec(**{**base_ssh, **settings})
            targets.append(target(node_name, node_name, python or base_python or DEFAULT_PYTHON,
                                  ssh, timeout))
    defaults: dict[str, Any] = {}
    written_ssh = {**base_ssh, **settings}
    if written_ssh:
        defaults["ssh"] = written_ssh
    if python or base_python:
        defaults["python"] = python or base_python
    if base_slurm is not None:
        defaults["slurm"] = base_slurm
    return SshReach(targets, addresses, extras, defaults)


def _host_names(hosts: Sequence[str]) -> list[str]:
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


def _probe_slurm(partition: str | None, node_list: str | None, python: str | None,
                 bound_s: float, torch: bool, import_torch: bool, *, output: Path | None,
                 yes: bool, name: str) -> int:
    """``probe --slurm``: the cluster's nodes (in ``partition``, among ``node_list``), each
    written with its partition and GRES type."""
    from orchestrate.backends.slurm.probe import Group, gather_through_slurm

    nodes = _slurm_nodes()
    if partition is not None:
        nodes = [n for n in nodes if partition in n.partitions]
        if not nodes:
            raise UserError.single("no Slurm node is in this partition", source="command line",
                                   field="--partition", got=partition,
                                   hint="`sinfo -s` lists the partitions")
    if node_list is not None:
        try:
            wanted = hostlist.expand(node_list)
        except ValueError as exc:
            raise UserError.single(f"not a hostlist: {exc}", source="command line",
                                   field="--nodes", got=node_list) from None
        known = {n.name for n in nodes}
        missing = [n for n in wanted if n not in known]
        if missing:
            raise UserError.single(
                "Slurm has no such node" + (f" in partition {partition}" if partition else ""),
                source="command line", field="--nodes", got=hostlist.compress(missing),
                hint="`sinfo -N` lists the nodes")
        nodes = [n for n in nodes if n.name in wanted]
    interpreter = python or DEFAULT_PYTHON
    by_partition: dict[str | None, list[Any]] = {}
    for node in nodes:
        chosen = partition or (node.partitions[0] if node.partitions else None)
        by_partition.setdefault(chosen, []).append(node)
    groups = [Group(tuple(members), part, interpreter) for part, members in by_partition.items()]
    gathered = gather_through_slurm(groups, bound_s=bound_s, torch=torch,
                                    import_torch=import_torch)
    extras: dict[str, dict[str, Any]] = {}
    for group in groups:
        for node in group.nodes:
            slurm = {k: v for k, v in (("partition", group.partition),
                                       ("gres_type", node.gres_type)) if v is not None}
            extras[node.name] = {"slurm": slurm}
    defaults = {"python": python} if python else {}
    return write_probed(gathered, output=output, yes=yes, inventory_name=name, extras=extras,
                        defaults=defaults)


def _slurm_nodes() -> list[Any]:
    from orchestrate.backends.slurm.ctl import SlurmClient, SlurmError
    from orchestrate.backends.slurm.probe import cluster_nodes

    try:
        return cluster_nodes(SlurmClient())
    except SlurmError as exc:
        raise UserError.single(f"cannot ask Slurm for its nodes: {exc}", source="slurm",
                               hint="run this where Slurm's commands work (scontrol, srun; "
                                    "SLURM_CONF, munge)") from None


def gather_local(peers: tuple[str, ...] = (), torch: bool = True,
                 import_torch: bool = False) -> dict[str, Any]:
    """This machine's raw facts, gathered in this process."""
    return hostfacts.gather(peers, torch=torch, import_torch=import_torch)


def _lift(extras: Mapping[str, Mapping[str, Any]], names: Sequence[str]
          ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """User fields every written node shares become defaults; the rest stay with their node."""
    common: dict[str, Any] = {}
    if names:
        first = extras.get(names[0], {})
        for key, value in first.items():
            if all(key in extras.get(n, {}) and extras[n][key] == value for n in names):
                common[key] = value
    rest = {n: {k: v for k, v in extras.get(n, {}).items() if k not in common} for n in names}
    return common, rest


def write_probed(
    gathered: Mapping[str, Gathered],
    *,
    output: Path | None,
    yes: bool = False,
    inventory_name: str | None = None,
    addresses: Mapping[str, str] | None = None,
    extras: Mapping[str, Mapping[str, Any]] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> int:
    """Everything ``probe`` does after gathering: the table of findings, then the inventory on
    stdout or into ``output`` (merged into it when it exists, after showing the diff and, unless
    ``yes``, asking). Nodes that could not be probed, or whose nvidia-smi fails, are reported
    and left out (kept as they were when merging); then the exit status is 1.

    ``extras``: per node, the user fields its transport knows (``ssh``, ``python``, ``slurm``);
    ``defaults``: the ``defaults:`` of a new file (how all nodes were reached). Fields every
    written node shares move into a new file's defaults; into an existing file they go with
    each new node, unless its defaults already say the same."""
    addresses = addresses or {}
    extras = extras or {}
    parsed: dict[str, HostFacts] = {}
    failed: dict[str, str] = {}
    for name, raw in gathered.items():
        if isinstance(raw, Unreachable):
            failed[name] = raw.reason
            continue
        facts = parse_facts(raw)
        parsed[name] = facts
        if facts.gpu_status == "failed":
            failed[name] = f"nvidia-smi failed: {facts.gpu_error}"
    out = console(stderr=output is None)
    out.print(findings_table(parsed))
    from rich.markup import escape  # rich only when a table is drawn (tables.py)

    for name, reason in failed.items():
        out.print(f"[red]{escape(name)}:[/] {escape(reason)} (left out of the inventory)",
                  highlight=False)
    kept = [name for name in parsed if name not in failed]
    status = EXIT_DRIFT if failed else 0
    if not kept:
        out.print("nothing to write: no node was probed", highlight=False)
        return EXIT_DRIFT
    name = inventory_name or (output.stem if output is not None else "local")
    old = _read(output) if output is not None else None
    if old is None:
        common, own = _lift(extras, kept)
        probed = {n: ProbedNode(n, parsed[n], addresses.get(n), own[n]) for n in kept}
        text = render_inventory(name, probed.values(), {**common, **(defaults or {})})
        _check_valid(text, str(output) if output is not None else "<probed inventory>")
        if output is None:
            click.echo(text, nl=False)
        else:
            output.write_text(text, encoding="utf-8")
            out.print(f"wrote {output}", highlight=False)
        return status
    assert output is not None
    probed = {n: ProbedNode(n, parsed[n], addresses.get(n), dict(extras.get(n, {})))
              for n in kept}
    text = merge_inventory(old, str(output), probed)
    _check_valid(text, str(output))
    if text == old:
        out.print(f"{output} is up to date", highlight=False)
        return status
    click.echo(unified_diff(old, text, str(output)), nl=False)
    if not yes:
        if not sys.stdin.isatty():
            raise UserError.single(
                "exists and would change; not overwriting it without a yes",
                source=str(output),
                hint="read the diff above, then run again with --yes (or from a terminal)",
            )
        if not click.confirm(f"write these changes to {output}?", default=False):
            out.print(f"{output} left as it was", highlight=False)
            return status
    output.write_text(text, encoding="utf-8")
    out.print(f"updated {output}", highlight=False)
    return status


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UserError.single(f"cannot read: {exc.strerror}", source=str(path)) from None


def _check_valid(text: str, source: str) -> None:
    """What probe writes must pass ``orchestrate validate``: checked before any write."""
    data, lines = parse_yaml(text, source)
    resolve_inventory(validate(InventorySpec, data, source, lines), source, lines)


def findings_table(parsed: Mapping[str, HostFacts]) -> Any:
    """One row per probed node: GPUs by model with CUDA indices, link, network, CPUs, memory,
    driver and torch, and what went wrong."""
    from rich.markup import escape as markup_escape
    from rich.table import Table

    table = Table(title=f"probed {len(parsed)} node(s)")
    for column in ("node", "host", "GPUs (CUDA index, PCI bus order)", "link", "network",
                   "CPUs / memory", "driver / torch", "notes"):
        table.add_column(column)
    for name, facts in parsed.items():
        groups: dict[str, list[int]] = {}
        for gpu in facts.gpus:
            groups.setdefault(f"{gpu.model} {gpu.memory_gb:g}GB", []).append(gpu.cuda_index)
        gpus = "; ".join(f"{len(ix)}x {label} [{','.join(map(str, ix))}]"
                         for label, ix in groups.items()) or "none (CPU node)"
        net = facts.network
        network = "-" if net is None else " ".join(
            x for x in (net.fabric, net.interface or "", f"{net.gbps:g}Gb/s" if net.gbps else "",
                        net.hca or "") if x)
        memory = f"{facts.memory_gb:g} GB" if facts.memory_gb else "?"
        notes = list(facts.problems)
        if facts.network_note:
            notes.append(facts.network_note)
        cells = (name, facts.hostname, gpus, f"{facts.link.link}: {facts.link.detail}",
                 network, f"{facts.cpus or '?'} / {memory}",
                 f"{facts.driver or '-'} / {facts.torch or facts.torch_error or '-'}",
                 "\n".join(notes))
        table.add_row(*(markup_escape(cell) for cell in cells))  # hosts' words are not markup
    return table


# ------------------------------------------------------------------------------------ check


@inventory.command("check")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--no-torch", is_flag=True, help="do not look for torch on the nodes")
@click.option("--import-torch", is_flag=True,
              help="import torch on each node to prove it loads (seconds per node)")
@click.option("--timeout", "bound_s", type=click.FloatRange(min=1), default=DEFAULT_BOUND_S,
              help="seconds a node may take to answer once logged in (or its task started)")
@click.option("--fanout", type=click.IntRange(min=1), default=32,
              help="hosts logged into at once")
def inventory_check(file: Path, as_json: bool, no_torch: bool, import_torch: bool,
                    bound_s: float, fanout: int) -> int:
    """Probe the inventory's nodes and report where they differ from the file: exit 0 when
    everything matches, 1 on drift or a node that could not be probed, 2 on a mistake in the
    file or the command. Nodes are reached the way the file says: Slurm's through srun, this
    machine's in this process, the others over SSH with the file's ssh settings."""
    from orchestrate.core.spec.inventory import load_inventory_spec

    spec, lines = load_inventory_spec(file)
    inv = resolve_inventory(spec, str(file), lines)
    text = _read(file) or ""
    gathered = gather_for_check(inv, slurm_nodes_of(spec), torch=not no_torch,
                                import_torch=import_torch, bound_s=bound_s, fanout=fanout)
    return check_gathered(inv, text, str(file), gathered, as_json=as_json)


def is_this_machine(address: str) -> bool:
    """Whether ``address`` names this machine: loopback, or its own host name."""
    if address in ("localhost", "::1") or address.startswith("127."):
        return True
    return address in (socket.gethostname(), socket.getfqdn())


def slurm_nodes_of(spec: InventorySpec) -> set[str]:
    """The nodes the file says Slurm runs: those whose entry, or the defaults, have a
    ``slurm:`` block (even an empty one). Their jobs go through Slurm, so their probe does too:
    compute nodes often refuse SSH from outside a job (pam_slurm_adopt), and srun reaches
    them wherever the controller is configured."""
    names: set[str] = set()
    for entry in spec.nodes:
        if entry.slurm is not None or spec.defaults.slurm is not None:
            names.update(hostlist.expand(entry.name))
    return names


def gather_for_check(inv: Inventory, slurm: Collection[str] = (), *, torch: bool = True,
                     import_torch: bool = False, bound_s: float = DEFAULT_BOUND_S,
                     fanout: int = 32) -> dict[str, Gathered]:
    """Raw facts for every node of ``inv``, each reached as the file says: the ``slurm`` nodes
    through srun (in their partition, with their python), nodes on this machine in this
    process (gathered once), the others over SSH with their ssh settings and python."""
    on_slurm = [n for n in inv.nodes if n.name in slurm]
    here = [n for n in inv.nodes if n.name not in slurm and is_this_machine(n.address)]
    remote = [n for n in inv.nodes if n.name not in slurm and not is_this_machine(n.address)]
    gathered: dict[str, Gathered] = {}
    if here:
        facts = gather_local(torch=torch, import_torch=import_torch)
        gathered.update({node.name: facts for node in here})
    if remote:
        from orchestrate.backends.ssh.connections import target
        from orchestrate.backends.ssh.probe import gather_over_ssh

        targets = [target(n.name, n.address, n.python or DEFAULT_PYTHON, n.ssh,
                          DEFAULT_CONNECT_TIMEOUT_S) for n in remote]
        gathered.update(gather_over_ssh(targets, bound_s=bound_s, fanout=fanout, torch=torch,
                                        import_torch=import_torch))
    if on_slurm:
        gathered.update(_gather_slurm_nodes(on_slurm, bound_s, torch, import_torch))
    return {node.name: gathered[node.name] for node in inv.nodes}


def _gather_slurm_nodes(nodes: Sequence[Node], bound_s: float, torch: bool,
                        import_torch: bool) -> dict[str, Gathered]:
    """Inventory nodes probed through Slurm: one srun per partition and python."""
    from orchestrate.backends.slurm.probe import Group, gather_through_slurm

    known = {n.name: n for n in _slurm_nodes()}
    gathered: dict[str, Gathered] = {}
    grouped: dict[tuple[str | None, str], list[Any]] = {}
    for node in nodes:
        found = known.get(node.name)
        if found is None:
            gathered[node.name] = Unreachable("Slurm has no node of this name (`sinfo -N`)")
            continue
        partition = node.partition or (found.partitions[0] if found.partitions else None)
        grouped.setdefault((partition, node.python or DEFAULT_PYTHON), []).append(found)
    groups = [Group(tuple(members), partition, python)
              for (partition, python), members in grouped.items()]
    if groups:
        gathered.update(gather_through_slurm(groups, bound_s=bound_s, torch=torch,
                                             import_torch=import_torch))
    return gathered


def check_gathered(inv: Inventory, text: str, source: str, gathered: Mapping[str, Gathered],
                   *, as_json: bool = False) -> int:
    """Everything ``check`` does after gathering: compare, print, and the exit status."""
    parsed = {n: parse_facts(r) for n, r in gathered.items() if not isinstance(r, Unreachable)}
    unreachable = {n: r.reason for n, r in gathered.items() if isinstance(r, Unreachable)}
    differences = drift(inv, parsed, provenance_of(text, source), unreachable)
    if as_json:
        click.echo(json.dumps({
            "file": source,
            "nodes": [n.name for n in inv.nodes if n.name in gathered],
            "ok": not differences,
            "differences": [d.to_json() for d in differences],
        }, indent=2))
    elif differences:
        for difference in differences:
            click.echo(difference.message)
        nodes = len({d.node for d in differences})
        click.echo(f"{len(differences)} difference(s) on {nodes} node(s) of {source}")
    else:
        click.echo(f"{source}: all {len(parsed)} node(s) match")
    return EXIT_DRIFT if differences else 0
