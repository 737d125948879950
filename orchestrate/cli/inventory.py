"""``orchestrate inventory``: show an inventory, write one from the machines, check for drift.

``probe`` and ``check`` are built in two halves so that each transport only has to gather:

- gathering returns a mapping of node name -> the raw facts of
  :func:`orchestrate.hostside.hostfacts.gather` run on that node, or
  :class:`~orchestrate.probe.gathering.Unreachable`. This machine (``--local``) is gathered in
  this process (:func:`orchestrate.probe.machine.gather_local`); hosts over SSH (``probe
  HOST...``, ``--from``) by :mod:`orchestrate.backends.ssh.probe`; a Slurm cluster's nodes
  (``--slurm``) by :mod:`orchestrate.backends.slurm.probe`; ``check`` reaches each node the way
  its file says (:mod:`orchestrate.backends.probe`);
- :func:`write_probed` and :func:`check_gathered` do everything after that: what to write and
  what differs come from :mod:`orchestrate.probe.write`; here the findings table is drawn, the
  diff shown, the user asked, the file written, and the exit status chosen (0 all matched /
  written, 1 drift or a node that could not be probed, 2 a user error).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from orchestrate.cli.tables import console, inventory_table
from orchestrate.core.errors import UserError
from orchestrate.core.spec import hostlist
from orchestrate.core.spec.inventory import Inventory, load_inventory, resolve_inventory
from orchestrate.probe.facts import ProbedHost
from orchestrate.probe.gathering import (
    DEFAULT_BOUND_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_PYTHON,
    Gathered,
)
from orchestrate.probe.inventoryfile import unified_diff
from orchestrate.probe.machine import LOCAL_ADDRESS, LOCAL_NAME, gather_local
from orchestrate.probe.write import EXIT_DRIFT, check, inventory_text, read_gathered

__all__ = ["check_gathered", "findings_table", "write_probed"]


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

_SSH_FLAGS = ("ssh_config", "user", "port", "identity", "known_hosts", "accept_unknown_host_keys",
              "connect_timeout", "fanout")


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
    from orchestrate.backends.ssh.probe import gather_over_ssh, ssh_reach

    reach = ssh_reach(hosts, from_file, {k: v for k, v in settings.items() if v is not None},
                      python)

    from orchestrate.cli.progress import progress

    found: dict[str, str] = {}  # a resolvable address for each alias (MASTER_ADDR)
    with progress(f"probing {len(reach.targets)} host(s)"):  # each step, on which hosts
        gathered = dict(gather_over_ssh(reach.targets, bound_s=bound_s, fanout=fanout,
                                        torch=torch, import_torch=import_torch,
                                        addresses=found))
    return write_probed(gathered, output=output, yes=yes, inventory_name=name or "hosts",
                        addresses={**found, **reach.addresses}, extras=reach.extras,
                        defaults=reach.defaults)


def _path(path: Path | None) -> str | None:
    """A file named on the command line, absolute (it is written into the inventory, which may
    be used from elsewhere); ``~`` is kept for the reader to expand."""
    if path is None:
        return None
    text = str(path)
    return text if text.startswith("~") else os.path.abspath(text)


def _probe_slurm(partition: str | None, node_list: str | None, python: str | None,
                 bound_s: float, torch: bool, import_torch: bool, *, output: Path | None,
                 yes: bool, name: str) -> int:
    """``probe --slurm``: the cluster's nodes (in ``partition``, among ``node_list``), each
    written with its partition and GRES type."""
    from orchestrate.backends.slurm.probe import gather_cluster, known_nodes

    nodes = known_nodes()
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
    from orchestrate.cli.progress import progress

    with progress(f"probing {len(nodes)} Slurm node(s)"):
        gathered, extras = gather_cluster(nodes, partition, python, bound_s=bound_s,
                                          torch=torch, import_torch=import_torch)
    defaults = {"python": python} if python else {}
    return write_probed(gathered, output=output, yes=yes, inventory_name=name, extras=extras,
                        defaults=defaults)


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
    and left out (kept as they were when merging); then the exit status is 1. ``addresses``,
    ``extras`` and ``defaults``: as :func:`orchestrate.probe.write.inventory_text` takes them."""
    probed = read_gathered(gathered)
    out = console(stderr=output is None)
    out.print(findings_table(probed.parsed))
    from rich.markup import escape  # rich only when a table is drawn (tables.py)

    for name, reason in probed.failed.items():
        out.print(f"[red]{escape(name)}:[/] {escape(reason)} (left out of the inventory)",
                  highlight=False)
    if not probed.kept:
        out.print("nothing to write: no node was probed", highlight=False)
        return EXIT_DRIFT
    old = _read(output) if output is not None else None
    text = inventory_text(
        probed, old=old, source=str(output) if output is not None else "<probed inventory>",
        name=inventory_name or (output.stem if output is not None else "local"),
        addresses=addresses, extras=extras, defaults=defaults)
    if output is None:
        click.echo(text, nl=False)
    elif old is None:
        output.parent.mkdir(parents=True, exist_ok=True)  # -o newdir/x.yaml: made, as cp does not
        output.write_text(text, encoding="utf-8")
        out.print(f"wrote {output}", highlight=False)
    elif text == old:
        out.print(f"{output} is up to date", highlight=False)
    elif _confirmed(output, old, text, yes, out):
        output.write_text(text, encoding="utf-8")
        out.print(f"updated {output}", highlight=False)
    return probed.status


def _confirmed(output: Path, old: str, text: str, yes: bool, out: Any) -> bool:
    """Show what writing ``text`` over ``output`` changes; then whether to write it (``yes``,
    or the user said so; without a terminal to ask, a UserError)."""
    click.echo(unified_diff(old, text, str(output)), nl=False)
    if yes:
        return True
    if not sys.stdin.isatty():
        raise UserError.single(
            "exists and would change; not overwriting it without a yes",
            source=str(output),
            hint="read the diff above, then run again with --yes (or from a terminal)",
        )
    if click.confirm(f"write these changes to {output}?", default=False):
        return True
    out.print(f"{output} left as it was", highlight=False)
    return False


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UserError.single(f"cannot read: {exc.strerror}", source=str(path)) from None


def findings_table(parsed: Mapping[str, ProbedHost]) -> Any:
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
    from orchestrate.backends.probe import gather_for_check, slurm_nodes_of
    from orchestrate.core.spec.inventory import load_inventory_spec

    spec, lines = load_inventory_spec(file)
    inv = resolve_inventory(spec, str(file), lines)
    text = _read(file) or ""
    from orchestrate.cli.progress import progress

    with progress(f"probing {len(inv.nodes)} node(s)", enabled=not as_json):
        gathered = gather_for_check(inv, slurm_nodes_of(spec), torch=not no_torch,
                                    import_torch=import_torch, bound_s=bound_s, fanout=fanout)
    return check_gathered(inv, text, str(file), gathered, as_json=as_json)


def check_gathered(inv: Inventory, text: str, source: str, gathered: Mapping[str, Gathered],
                   *, as_json: bool = False) -> int:
    """Everything ``check`` does after gathering: compare, print, and the exit status."""
    report = check(inv, text, source, gathered)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        for line in report.lines():
            click.echo(line)
    return report.status
