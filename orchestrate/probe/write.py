"""What ``inventory probe`` writes and what ``inventory check`` reports, from gathered facts.

Whatever transport gathered them (this machine, SSH, Slurm), the facts arrive as node name ->
the dict of :func:`orchestrate.hostside.hostfacts.gather`, or
:class:`~orchestrate.probe.gathering.Unreachable`. From there:

- :func:`read_gathered` parses them and sets aside the nodes that cannot be written (not
  reached, or their nvidia-smi fails), with why;
- :func:`inventory_text` is the file to write: a new inventory (identical nodes folded, the
  user fields every node shares lifted into ``defaults``), or the existing file with the probed
  fields merged in (:mod:`orchestrate.probe.inventoryfile`); either way checked to pass
  ``orchestrate validate`` first;
- :func:`check` compares the facts with an inventory (:mod:`orchestrate.probe.drift`).

Pure: values and text in, values and text out. The CLI (:mod:`orchestrate.cli.inventory`)
draws the findings table, shows the diff, asks, writes the file and prints the report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrate.core.spec.inventory import Inventory, InventorySpec, resolve_inventory
from orchestrate.core.spec.loader import parse_yaml, validate
from orchestrate.probe.drift import Difference, drift
from orchestrate.probe.facts import ProbedHost, parse_facts
from orchestrate.probe.gathering import Gathered, Unreachable
from orchestrate.probe.inventoryfile import ProbedNode, merge_inventory, render_inventory
from orchestrate.probe.provenance import provenance_of

#: The exit status of a probe that left a node out, and of a check that found drift.
EXIT_DRIFT = 1


@dataclass(frozen=True)
class Probed:
    """Gathered facts, parsed: every node that answered, and the nodes left out with why (not
    reached, or nvidia-smi failing: a node whose GPUs cannot be listed is not written)."""

    parsed: dict[str, ProbedHost]
    failed: dict[str, str]

    @property
    def kept(self) -> list[str]:
        """The nodes to write, in the order they were gathered."""
        return [name for name in self.parsed if name not in self.failed]

    @property
    def status(self) -> int:
        """0, or :data:`EXIT_DRIFT` when a node was left out."""
        return EXIT_DRIFT if self.failed else 0


def read_gathered(gathered: Mapping[str, Gathered]) -> Probed:
    """Parse every node's facts; note those that cannot be written."""
    parsed: dict[str, ProbedHost] = {}
    failed: dict[str, str] = {}
    for name, raw in gathered.items():
        if isinstance(raw, Unreachable):
            failed[name] = raw.reason
            continue
        facts = parse_facts(raw)
        parsed[name] = facts
        if facts.gpu_status == "failed":
            failed[name] = f"nvidia-smi failed: {facts.gpu_error}"
    return Probed(parsed, failed)


def lift(extras: Mapping[str, Mapping[str, Any]], names: Sequence[str]
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


def inventory_text(
    probed: Probed,
    *,
    old: str | None,
    source: str,
    name: str,
    addresses: Mapping[str, str] | None = None,
    extras: Mapping[str, Mapping[str, Any]] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> str:
    """The inventory to write for the kept nodes: a new file (``old`` None) or ``old`` with
    the probed fields merged in; raises UserError when it would not pass validation.

    ``extras``: per node, the user fields its transport knows (``ssh``, ``python``, ``slurm``);
    ``defaults``: the ``defaults:`` of a new file (how all nodes were reached). Fields every
    written node shares move into a new file's defaults; into an existing file they go with
    each new node, unless its defaults already say the same."""
    addresses = addresses or {}
    extras = extras or {}
    kept = probed.kept
    if old is None:
        common, own = lift(extras, kept)
        nodes = [ProbedNode(n, probed.parsed[n], addresses.get(n), own[n]) for n in kept]
        text = render_inventory(name, nodes, {**common, **(defaults or {})})
    else:
        merged = {n: ProbedNode(n, probed.parsed[n], addresses.get(n), dict(extras.get(n, {})))
                  for n in kept}
        text = merge_inventory(old, source, merged)
    check_valid(text, source)
    return text


def check_valid(text: str, source: str) -> None:
    """What probe writes must pass ``orchestrate validate``: checked before any write."""
    data, lines = parse_yaml(text, source)
    resolve_inventory(validate(InventorySpec, data, source, lines), source, lines)


@dataclass(frozen=True)
class CheckReport:
    """What ``inventory check`` found: every difference between the file and the nodes."""

    source: str
    nodes: list[str]  # the file's nodes that were gathered (reached or not), in its order
    matched: int  # how many nodes answered
    differences: list[Difference]

    @property
    def status(self) -> int:
        """0 when everything matches, else :data:`EXIT_DRIFT`."""
        return EXIT_DRIFT if self.differences else 0

    def to_json(self) -> dict[str, Any]:
        """``check --json``."""
        return {"file": self.source, "nodes": self.nodes, "ok": not self.differences,
                "differences": [d.to_json() for d in self.differences]}

    def lines(self) -> list[str]:
        """``check``'s text: one line per difference and a count, or that all match."""
        if not self.differences:
            return [f"{self.source}: all {self.matched} node(s) match"]
        nodes = len({d.node for d in self.differences})
        return [*(d.message for d in self.differences),
                f"{len(self.differences)} difference(s) on {nodes} node(s) of {self.source}"]


def check(inv: Inventory, text: str, source: str, gathered: Mapping[str, Gathered]
          ) -> CheckReport:
    """Compare the gathered facts with ``inv`` (whose file's text is ``text``: its provenance
    comments say which driver and torch each node was probed with)."""
    parsed = {n: parse_facts(r) for n, r in gathered.items() if not isinstance(r, Unreachable)}
    unreachable = {n: r.reason for n, r in gathered.items() if isinstance(r, Unreachable)}
    differences = drift(inv, parsed, provenance_of(text, source), unreachable)
    return CheckReport(source, [n.name for n in inv.nodes if n.name in gathered], len(parsed),
                       differences)


__all__ = ["EXIT_DRIFT", "CheckReport", "Probed", "check", "check_valid", "inventory_text",
           "lift", "read_gathered"]
