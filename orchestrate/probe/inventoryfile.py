"""Inventory files written from probed facts, merged into the file a person keeps, and diffed.

Pure: facts and text in, text out (reading and writing files is the CLI's job). Three jobs:

- :func:`render_inventory` writes a new inventory from :class:`ProbedNode` values: GPUs grouped
  by model with CUDA indices, ``slots`` for CPU nodes, identical nodes folded into one hostlist
  entry (``gpu[01-16]``), and above each entry a provenance comment saying when it was probed
  and from which driver and torch (:mod:`orchestrate.probe.provenance`; ``inventory check``
  reads it back).
- :func:`merge_inventory` updates an existing file in place: only the fields probing knows
  (``cpus``, ``gpus``/``slots``, ``gpu_link``, ``network``) change; names, addresses, ``ssh``,
  ``python``, ``slurm``, ``defaults`` and the comments above entries are kept, an entry whose
  values did not change keeps its text byte for byte, and a hostlist entry whose nodes now
  differ is split. Comments inside a changed entry are lost (it is written anew).
- :func:`unified_diff` shows what a write would change.

The YAML is written by hand, not by a dumper, so that it reads like the README's inventories
(flow mappings for GPU groups and networks) and carries comments.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from orchestrate.core.spec import hostlist
from orchestrate.core.spec.inventory import InventorySpec, NetworkSpec
from orchestrate.core.spec.loader import parse_yaml, validate
from orchestrate.probe.facts import ProbedHost
from orchestrate.probe.provenance import (
    Provenance,
    comment_block,
    is_provenance,
    provenance,
    read_provenance,
)

#: The fields probing owns; everything else in an entry is the user's.
PROBED_FIELDS = ("cpus", "gpus", "slots", "gpu_link", "numa", "gpu_islands", "network",
                 "containers")
_ORDER = ("name", "address", "ssh", "python", "cpus", "gpus", "slots", "gpu_link", "numa",
          "gpu_islands", "network", "containers", "slurm")
#: Fields written as a block list, one item a line (``gpus:`` then ``- {model: ...}``).
_BLOCK_LISTS = ("gpus", "numa", "gpu_islands")

HEADER = (
    "# Written by `orchestrate inventory probe`. GPU indices are CUDA indices in PCI bus order\n"
    "# (orchestrate sets CUDA_DEVICE_ORDER=PCI_BUS_ID). The \"probed\" comment above a node says\n"
    "# where its values came from; `orchestrate inventory check FILE` compares them with the\n"
    "# machines. Edit freely: probing again keeps names, addresses, ssh, python and slurm.\n"
)

# ------------------------------------------------------------------------------------- entries


@dataclass(frozen=True)
class ProbedNode:
    """A node to write: its name (as the user calls it), an address when it is not the name,
    its parsed facts, and the user fields the transport knows for it (``ssh``, ``python``,
    ``slurm``: how it was reached), written when the node is new to the file."""

    name: str
    facts: ProbedHost
    address: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


def probed_fields(facts: ProbedHost) -> dict[str, Any]:
    """The entry fields probing sets, in the order a person writes them."""
    entry: dict[str, Any] = {}
    if facts.cpus:
        entry["cpus"] = facts.cpus
    if facts.gpus:
        groups: dict[tuple[str, float], list[int]] = {}
        for gpu in facts.gpus:
            groups.setdefault((gpu.model, gpu.memory_gb), []).append(gpu.cuda_index)
        entry["gpus"] = [
            {"model": model, "memory_gb": _whole(memory),
             **({"count": len(indices)} if len(groups) == 1 and indices == list(
                 range(len(indices))) else {"indices": indices})}
            for (model, memory), indices in groups.items()
        ]
        entry["gpu_link"] = facts.link.link
        if facts.numa:
            entry["numa"] = [{"node": n.node, "cpus": n.cpus, "gpus": list(n.gpus)}
                             for n in facts.numa]
        if facts.islands:
            entry["gpu_islands"] = [{"gpus": list(i.gpus), "via": i.via} for i in facts.islands]
    else:
        entry["slots"] = facts.cpus or 1
    if facts.network is not None:
        entry["network"] = _network(facts.network)
    if facts.containers:  # the runtimes found (docs/containers.md); none found: left unknown
        entry["containers"] = list(facts.containers)
    return entry


def _network(network: NetworkSpec) -> dict[str, Any]:
    return {k: _whole(v) if isinstance(v, float) else v
            for k, v in network.model_dump().items() if v is not None}


def _whole(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def _fold(nodes: Iterable[ProbedNode]) -> list[tuple[str, ProbedNode, Provenance, dict[str, Any]]]:
    """Nodes with identical fields and provenance (and no address of their own) share one
    hostlist entry; the result keeps first-appearance order."""
    groups: dict[str, list[tuple[ProbedNode, Provenance, dict[str, Any]]]] = {}
    for node in nodes:
        fields = {**probed_fields(node.facts), **node.extra}
        prov = provenance(node.facts)
        key = json.dumps([fields, prov.key()], sort_keys=True)
        if node.address is not None:
            key += "\0" + node.name
        groups.setdefault(key, []).append((node, prov, fields))
    out = []
    for members in groups.values():
        names = sorted((m[0].name for m in members), key=_natural)
        first = members[0]
        when = min(m[1].when for m in members)
        prov = Provenance(when, first[1].driver, first[1].torch, first[1].topology)
        out.append((hostlist.compress(names), first[0], prov, first[2]))
    return out


def _natural(name: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


# ------------------------------------------------------------------------------------ emitting

_PLAIN = re.compile(r"^[A-Za-z0-9_./~+@%][A-Za-z0-9_./~+@%:=\-]*$")


def scalar(value: Any) -> str:
    """One YAML scalar that reads back as ``value`` (quoted only when it must be)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    text = str(value)
    if _PLAIN.match(text) and yaml.safe_load(text) == text:
        return text
    return json.dumps(text)  # a JSON string is a YAML double-quoted scalar


def flow(value: Any) -> str:
    """A value on one line: ``{a: 1, b: [2, 3]}``."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{scalar(k)}: {flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(flow(v) for v in value) + "]"
    return scalar(value)


def entry_lines(entry: Mapping[str, Any], indent: int = 2) -> list[str]:
    """A node entry as a block list item: ``- name: x`` then one line per field."""
    pad = " " * indent
    out = []
    for i, (key, value) in enumerate(entry.items()):
        lead = f"{pad}- " if i == 0 else f"{pad}  "
        if key in _BLOCK_LISTS and isinstance(value, list) and value:
            out.append(f"{lead}{key}:")
            out.extend(f"{pad}    - {flow(group)}" for group in value)
        else:
            out.append(f"{lead}{scalar(key)}: {flow(value)}")
    return out


def _ordered(entry: Mapping[str, Any]) -> dict[str, Any]:
    rank = {k: i for i, k in enumerate(_ORDER)}
    return dict(sorted(entry.items(), key=lambda kv: rank.get(kv[0], len(rank))))


def render_inventory(name: str, nodes: Iterable[ProbedNode],
                     defaults: Mapping[str, Any] | None = None) -> str:
    """A new inventory file for the probed nodes; ``defaults`` (``ssh``, ``python``, ``slurm``:
    how every node was reached) become its ``defaults:`` block."""
    out = [HEADER.rstrip("\n"), f"name: {scalar(name)}"]
    if defaults:
        out.append("defaults:")
        out.extend(f"  {scalar(k)}: {flow(v)}" for k, v in _ordered(defaults).items())
    out.append("nodes:")
    for entry_name, node, prov, fields in _fold(nodes):
        entry: dict[str, Any] = {"name": entry_name}
        if node.address is not None:
            entry["address"] = node.address
        entry.update(fields)
        out.extend("  " + line for line in prov.comment())
        out.extend(entry_lines(_ordered(entry)))
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------- merging


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _same_network(a: Any, b: Any) -> bool:
    if not isinstance(a, Mapping) or not isinstance(b, Mapping):
        return False
    try:
        return NetworkSpec(**a).model_dump() == NetworkSpec(**b).model_dump()
    except (TypeError, ValueError):
        return False


#: The fields a probe replaces in an entry that has them.
_MERGED = ("cpus", "gpu_link", "numa", "gpu_islands", "network", "gpus", "containers")


def apply_probed(old: Mapping[str, Any], fields: Mapping[str, Any],
                 defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``old`` with the probed ``fields`` in, user fields and key order kept.

    A value the node already gets (from ``defaults``, or the built-in ``gpu_link: pcie`` of a
    GPU node) is not added to it (one the user wrote is kept, updated); a value probing did not
    find (no network chosen) leaves the user's as it was; a CPU node keeps the ``slots`` its
    user chose. New keys go where a person puts them (``gpu_link`` after ``gpus``)."""
    kind = "gpus" if "gpus" in fields else "slots"
    other = "slots" if kind == "gpus" else "gpus"
    new: dict[str, Any] = {}
    for key, value in old.items():
        if key == other:
            key, value = kind, fields[kind]  # the node changed kind: same place in the entry
        elif key in _MERGED and key in fields:
            value = fields[key]
        new[key] = value
    if kind == "slots" and "slots" in old and "gpus" not in old:
        new["slots"] = old["slots"]
    implicit = {"gpu_link": "pcie"} if kind == "gpus" else {}
    for key in ("cpus", kind, "gpu_link", "numa", "gpu_islands", "network", "containers"):
        if key not in fields:
            continue
        inherited = defaults.get(key, implicit.get(key))
        same = _same_network(fields[key], inherited) if key == "network" \
            else _same(fields[key], inherited)
        if key not in new and not (same and key != kind):
            new = _insert(new, key, fields[key])  # (a value the node gets anyway is not added)
    return new


def _insert(entry: Mapping[str, Any], key: str, value: Any) -> dict[str, Any]:
    """``entry`` with ``key`` placed after the last key that comes before it in a person's
    order (name, address, ssh, python, cpus, gpus, gpu_link, network, slurm)."""
    rank = {k: i for i, k in enumerate(_ORDER)}
    mine = rank.get(key, len(rank))
    items = list(entry.items())
    at = len(items)
    for i, (k, _) in enumerate(items):
        if rank.get(k, -1) > mine:
            at = i
            break
    items.insert(at, (key, value))
    return dict(items)


@dataclass
class _Entry:
    comments: list[str]
    body: list[str] | None  # the original text, kept when nothing changed
    data: dict[str, Any]
    indent: int


@dataclass(frozen=True)
class _Layout:
    """Where the file's node entries are: its lines, each entry's first line, the ``nodes:``
    key's line and the first line after the list (0-based). ``block``: the nodes are a plain
    block list (``- name: ...`` items), whose text can be kept entry by entry."""

    lines: list[str]
    starts: list[int]
    nodes_key: int
    nodes_end: int
    block: bool

    @classmethod
    def of(cls, text: str, lines: Mapping[tuple[str, ...], int], count: int) -> _Layout:
        text_lines = text.splitlines()
        starts = [lines[("nodes", str(i))] - 1 for i in range(count)]
        nodes_key = lines[("nodes",)] - 1
        after = [v - 1 for k, v in lines.items() if len(k) == 1 and v - 1 > nodes_key]
        block = len(set(starts)) == len(starts) and all(
            text_lines[s].lstrip().startswith("-") for s in starts) and starts[0] > nodes_key
        return cls(text_lines, starts, nodes_key, min(after) if after else len(text_lines),
                   block)

    def entry(self, i: int) -> tuple[list[str], list[str] | None, int]:
        """Entry ``i``'s comments above it, its text (None: not a block list) and indent."""
        if not self.block:
            return [], None, 2
        start = self.starts[i]
        end = (self.starts[i + 1] - len(comment_block(self.lines, self.starts[i + 1]))
               if i + 1 < len(self.starts) else self.nodes_end)
        body = self.lines[start:end]
        while body and not body[-1].strip():
            body.pop()
        indent = len(self.lines[start]) - len(self.lines[start].lstrip())
        return comment_block(self.lines, start), body, indent

    def around(self, data: Mapping[str, Any], entries: list[_Entry]) -> str:
        """The whole file again with these entries as its nodes."""
        block, lines = self.block, self.lines
        out = lines[:self.nodes_key] if block else _preamble(lines, data)
        out.append(lines[self.nodes_key].split("#")[0].rstrip() if block else "nodes:")
        for item in entries:
            out.extend(item.comments)
            out.extend(item.body if item.body is not None else entry_lines(item.data,
                                                                           item.indent))
        if block:
            out.extend(lines[self.nodes_end:])
        return "\n".join(out).rstrip("\n") + "\n"


def _merge_entry(raw: Mapping[str, Any], comments: list[str], body: list[str] | None,
                 indent: int, probed: Mapping[str, ProbedNode], defaults: Mapping[str, Any]
                 ) -> list[_Entry]:
    """One entry of the file with its probed nodes' fields: split where its nodes now differ
    (a hostlist), its text and comments kept where nothing changed."""
    groups: dict[str, tuple[list[str], ProbedNode | None]] = {}
    for node_name in hostlist.expand(str(raw["name"])):
        node = probed.get(node_name)
        key = "old" if node is None else json.dumps(
            [probed_fields(node.facts), provenance(node.facts).key()], sort_keys=True)
        groups.setdefault(key, ([], node))[0].append(node_name)
    whole = len(groups) == 1
    out = []
    for members, node in groups.values():
        entry = dict(raw)
        entry["name"] = raw["name"] if whole else hostlist.compress(members)
        if node is None:
            out.append(_Entry(comments, body if whole else None, entry, indent))
            continue
        updated = apply_probed(entry, probed_fields(node.facts), defaults)
        prov = provenance(node.facts)
        old_prov = read_provenance(comments)
        new_comments = [c for c in comments if not is_provenance(c)] + [
            " " * indent + c for c in prov.comment()]
        if whole and _same(updated, raw) and old_prov is not None \
                and old_prov.key() == prov.key():
            out.append(_Entry(comments, body, entry, indent))  # nothing changed
        elif whole and _same(updated, raw):
            out.append(_Entry(new_comments, body, entry, indent))
        else:
            out.append(_Entry(new_comments, None, updated, indent))
    return out


def _new_entries(nodes: Iterable[ProbedNode], defaults: Mapping[str, Any], indent: int
                 ) -> list[_Entry]:
    """Nodes the file did not have, folded, as they would be written into it (a value its
    defaults already give is not repeated)."""
    out = []
    for entry_name, node, prov, fields in _fold(nodes):
        fresh: dict[str, Any] = {"name": entry_name}
        if node.address is not None:
            fresh["address"] = node.address
        fresh.update(apply_probed({}, fields, defaults))
        fresh.update({k: v for k, v in node.extra.items()
                      if k not in fresh and not _same(v, defaults.get(k))})
        out.append(_Entry([" " * indent + c for c in prov.comment()], None, _ordered(fresh),
                          indent))
    return out


def merge_inventory(old_text: str, source: str, probed: Mapping[str, ProbedNode]) -> str:
    """``old_text`` with the probed nodes updated and new ones appended (see the module doc).

    Nodes of the file that are not in ``probed`` (unreachable ones) stay as they were."""
    data, lines = parse_yaml(old_text, source)
    validate(InventorySpec, data, source, lines)  # a broken file is the user's to fix first
    raw_nodes: list[dict[str, Any]] = data["nodes"]
    defaults: Mapping[str, Any] = data.get("defaults") or {}
    layout = _Layout.of(old_text, lines, len(raw_nodes))
    entries: list[_Entry] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_nodes):
        seen.update(hostlist.expand(str(raw["name"])))
        entries.extend(_merge_entry(raw, *layout.entry(i), probed, defaults))
    new_nodes = [node for node_name, node in probed.items() if node_name not in seen]
    entries.extend(_new_entries(new_nodes, defaults, entries[0].indent if entries else 2))
    return layout.around(data, entries)


def _preamble(text_lines: list[str], data: Mapping[str, Any]) -> list[str]:
    """A fresh head for a file whose nodes are not a plain block list: its leading comments,
    name and defaults."""
    out = []
    for line in text_lines:
        if line.strip() and not line.strip().startswith("#"):
            break
        out.append(line)
    out.append(f"name: {scalar(data['name'])}")
    defaults = data.get("defaults")
    if defaults:
        out.append("defaults:")
        out.extend(f"  {scalar(k)}: {flow(v)}" for k, v in defaults.items())
    return out


def unified_diff(old: str, new: str, path: str) -> str:
    """What writing ``new`` over ``old`` changes, as ``diff -u`` shows it."""
    return "".join(difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True),
        fromfile=f"{path} (now)", tofile=f"{path} (probed)",
    ))
