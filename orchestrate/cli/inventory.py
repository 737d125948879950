"""``orchestrate inventory``: show an inventory, write one from the machines, check for drift.

``probe`` and ``check`` are built in two halves so that each transport only has to gather:

- gathering runs :func:`orchestrate.hostfacts.gather` on every node and returns a mapping of
  node name -> raw facts dict, or :class:`Unreachable` for a node that could not be probed.
  This module gathers for this machine (``--local``; inventory nodes at 127.0.0.1/localhost);
  the SSH transport (``inventory probe HOST...``) and Slurm (``--slurm``) produce the same
  mapping from their hosts;
- :func:`write_probed` and :func:`check_gathered` do everything after that: parse, fold,
  merge, diff, ask, write, report, and choose the exit status (0 all matched / written,
  1 drift or a node that could not be probed, 2 a user error).
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from orchestrate import hostfacts
from orchestrate.cli import cli
from orchestrate.cli.tables import console, inventory_table
from orchestrate.drift import drift
from orchestrate.errors import UserError
from orchestrate.inventory import Inventory, load_inventory, resolve_inventory
from orchestrate.inventoryfile import (
    ProbedNode,
    merge_inventory,
    provenance_of,
    render_inventory,
    unified_diff,
)
from orchestrate.loader import parse_yaml, validate
from orchestrate.probing import HostFacts, parse_facts

#: The node name and address ``--local`` writes (the same as the local backend's machine).
LOCAL_NAME, LOCAL_ADDRESS = "localhost", "127.0.0.1"
EXIT_DRIFT = 1


@dataclass(frozen=True)
class Unreachable:
    """A node that could not be probed, and why (the transport's message)."""

    reason: str


Gathered = Mapping[str, Any] | Unreachable


@cli.group()
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


@inventory.command("probe")
@click.option("--local", "local", is_flag=True, help="probe this machine")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="write (or update) this inventory file instead of printing it")
@click.option("--yes", is_flag=True, help="overwrite without asking (the diff is still shown)")
@click.option("--name", "inventory_name", default=None,
              help="the inventory's name (default: the output file's stem, or 'local')")
@click.option("--no-torch", is_flag=True, help="do not look for torch on the nodes")
@click.option("--import-torch", is_flag=True,
              help="import torch on each node to prove it loads (seconds per node)")
def inventory_probe(local: bool, output: Path | None, yes: bool, inventory_name: str | None,
                    no_torch: bool, import_torch: bool) -> int:
    """Write an inventory from what the machines say: GPUs by model in CUDA order, their link,
    the network, CPUs. Over an existing file, only probed fields change (a diff is shown)."""
    if not local:
        raise UserError.single(
            "say which machines to probe", source="command line",
            hint="--local probes this machine",
        )
    gathered: dict[str, Gathered] = {
        LOCAL_NAME: gather_local(torch=not no_torch, import_torch=import_torch)
    }
    return write_probed(gathered, output=output, yes=yes, inventory_name=inventory_name,
                        addresses={LOCAL_NAME: LOCAL_ADDRESS})


def gather_local(peers: tuple[str, ...] = (), torch: bool = True,
                 import_torch: bool = False) -> dict[str, Any]:
    """This machine's raw facts, gathered in this process."""
    return hostfacts.gather(peers, torch=torch, import_torch=import_torch)


def write_probed(
    gathered: Mapping[str, Gathered],
    *,
    output: Path | None,
    yes: bool = False,
    inventory_name: str | None = None,
    addresses: Mapping[str, str] | None = None,
) -> int:
    """Everything ``probe`` does after gathering: the table of findings, then the inventory on
    stdout or into ``output`` (merged into it when it exists, after showing the diff and, unless
    ``yes``, asking). Nodes that could not be probed, or whose nvidia-smi fails, are reported
    and left out (kept as they were when merging); then the exit status is 1."""
    addresses = addresses or {}
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
    for name, reason in failed.items():
        out.print(f"[red]{name}:[/] {reason} (left out of the inventory)", highlight=False)
    probed = {
        name: ProbedNode(name, facts, addresses.get(name))
        for name, facts in parsed.items() if name not in failed
    }
    status = EXIT_DRIFT if failed else 0
    if not probed:
        out.print("nothing to write: no node was probed", highlight=False)
        return EXIT_DRIFT
    name = inventory_name or (output.stem if output is not None else "local")
    if output is None:
        text = render_inventory(name, probed.values())
        _check_valid(text, "<probed inventory>")
        click.echo(text, nl=False)
        return status
    old = _read(output)
    if old is None:
        text = render_inventory(name, probed.values())
        _check_valid(text, str(output))
        output.write_text(text, encoding="utf-8")
        out.print(f"wrote {output}", highlight=False)
        return status
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
    from orchestrate.inventory import InventorySpec

    data, lines = parse_yaml(text, source)
    resolve_inventory(validate(InventorySpec, data, source, lines), source, lines)


def findings_table(parsed: Mapping[str, HostFacts]) -> Any:
    """One row per probed node: GPUs by model with CUDA indices, link, network, CPUs, memory,
    driver and torch, and what went wrong."""
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
        table.add_row(name, facts.hostname, gpus, f"{facts.link.link}: {facts.link.detail}",
                      network, f"{facts.cpus or '?'} / {memory}",
                      f"{facts.driver or '-'} / {facts.torch or facts.torch_error or '-'}",
                      "\n".join(notes))
    return table


# ------------------------------------------------------------------------------------ check


@inventory.command("check")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--no-torch", is_flag=True, help="do not look for torch on the nodes")
@click.option("--import-torch", is_flag=True,
              help="import torch on each node to prove it loads (seconds per node)")
def inventory_check(file: Path, as_json: bool, no_torch: bool, import_torch: bool) -> int:
    """Probe the inventory's nodes and report where they differ from the file: exit 0 when
    everything matches, 1 on drift, 2 on a mistake in the file or the command."""
    inv = load_inventory(file)
    text = _read(file) or ""
    gathered = gather_for_check(inv, torch=not no_torch, import_torch=import_torch)
    return check_gathered(inv, text, str(file), gathered, as_json=as_json)


def is_this_machine(address: str) -> bool:
    """Whether ``address`` names this machine: loopback, or its own host name."""
    if address in ("localhost", "::1") or address.startswith("127."):
        return True
    return address in (socket.gethostname(), socket.getfqdn())


def gather_for_check(inv: Inventory, torch: bool = True,
                     import_torch: bool = False) -> dict[str, Gathered]:
    """Raw facts for every node of ``inv`` that is this machine (gathered once).

    Other nodes need a transport (SSH, Slurm); until one is wired in here they are refused."""
    remote = [n.name for n in inv.nodes if not is_this_machine(n.address)]
    if remote:
        raise UserError.single(
            "only nodes on this machine (127.0.0.1, localhost) can be checked from here",
            source=inv.source, field="nodes", got=", ".join(remote),
            hint="probing other machines needs the SSH or Slurm transport",
        )
    facts = gather_local(torch=torch, import_torch=import_torch)
    return {node.name: facts for node in inv.nodes}


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
