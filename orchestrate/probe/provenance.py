"""Where a node's values came from: the provenance comment above each entry probe writes.

::

    # probed 2026-11-30 14:03 UTC: driver 560.35.03, torch 2.13.0+cu128 (CUDA 12.8)
    # topology: NV18 between all 8 GPUs (NVSwitch); PCIe Gen5 x16
    - name: "gpu[01-16]"

:func:`provenance` makes it from freshly probed facts; :func:`provenance_of` reads it back from
a file, so ``inventory check`` can tell a changed driver, torch or PCIe capability from the
values alone. Identical nodes share an entry only when their provenance agrees too
(:meth:`Provenance.key`). Pure: text and facts in, values out.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from dataclasses import dataclass

from orchestrate.core.spec import hostlist
from orchestrate.core.spec.loader import parse_yaml
from orchestrate.probe.facts import ProbedHost

_PROBED_LINE = re.compile(r"^\s*#\s*probed (?P<when>[^:]+?(?::\d\d)?(?: UTC)?): (?P<rest>.*)$")
_TOPOLOGY_LINE = re.compile(r"^\s*#\s*topology: (?P<rest>.*)$")


@dataclass(frozen=True)
class Provenance:
    """Where a node's values came from, as its comment says."""

    when: str
    driver: str | None = None
    torch: str | None = None
    topology: str | None = None

    @property
    def pcie(self) -> str | None:
        """The ``PCIe GenN xW`` part of the topology line."""
        found = re.search(r"PCIe Gen[\d/?]+ x[\d/?]+", self.topology or "")
        return found.group(0) if found else None

    def key(self) -> tuple[str | None, ...]:
        """What must match for two nodes to share one entry (not the minute they answered)."""
        return (self.driver, self.torch, self.topology)

    def comment(self) -> list[str]:
        """The comment lines, without indentation."""
        head = f"# probed {self.when}: " + (
            f"driver {self.driver}" if self.driver else "no NVIDIA GPU"
        )
        if self.torch:
            head += f", torch {self.torch}"
        lines = [head]
        if self.topology:
            lines.append(f"# topology: {self.topology}")
        return lines


def provenance(facts: ProbedHost) -> Provenance:
    """The provenance of freshly gathered facts (dated by the host's own clock)."""
    when = "at an unknown time"
    if facts.time:
        stamp = datetime.datetime.fromtimestamp(facts.time, tz=datetime.timezone.utc)
        when = stamp.strftime("%Y-%m-%d %H:%M UTC")
    torch = None
    if facts.torch:
        extras = [f"CUDA {facts.torch_cuda}" if facts.torch_cuda else "",
                  f"NCCL {facts.nccl}" if facts.nccl else ""]
        extra = ", ".join(x for x in extras if x)
        torch = facts.torch + (f" ({extra})" if extra else "")
    elif facts.torch_error:
        torch = "none"
    topology = None
    if facts.gpus:
        parts = [facts.link.detail]
        pcie = facts.pcie()
        if pcie:
            parts.append(pcie)
        topology = "; ".join(parts)
    return Provenance(when=when, driver=facts.driver, torch=torch, topology=topology)


def provenance_of(text: str, source: str = "") -> dict[str, Provenance]:
    """Node name -> the provenance comment above its entry (hostlists expanded)."""
    data, lines = parse_yaml(text, source)
    out: dict[str, Provenance] = {}
    if not isinstance(data, Mapping) or not isinstance(data.get("nodes"), list):
        return out
    text_lines = text.splitlines()
    for i, entry in enumerate(data["nodes"]):
        start = lines.get(("nodes", str(i)))
        if start is None or not isinstance(entry, Mapping) or "name" not in entry:
            continue
        found = read_provenance(comment_block(text_lines, start - 1))
        if found is None:
            continue
        try:
            names = hostlist.expand(str(entry["name"]))
        except ValueError:
            continue
        for name in names:
            out[name] = found
    return out


def read_provenance(comments: list[str]) -> Provenance | None:
    when = driver = torch = topology = None
    for line in comments:
        probed = _PROBED_LINE.match(line)
        if probed:
            when = probed.group("when")
            rest = probed.group("rest")
            found = re.search(r"\bdriver (\S+?)(?:,|$|\s)", rest)
            driver = found.group(1) if found else None
            found = re.search(r"\btorch (\S+)", rest)
            torch = None
            if found:
                torch = found.group(1).rstrip(",")
                extra = re.search(r"\btorch \S+ (\([^)]*\))", rest)
                if extra:
                    torch += " " + extra.group(1)
        topo = _TOPOLOGY_LINE.match(line)
        if topo:
            topology = topo.group("rest").strip()
    if when is None:
        return None
    return Provenance(when=when, driver=driver, torch=torch, topology=topology)


def is_provenance(line: str) -> bool:
    return bool(_PROBED_LINE.match(line) or _TOPOLOGY_LINE.match(line))


def comment_block(text_lines: list[str], index: int) -> list[str]:
    """The comment lines right above line ``index`` (0-based), top first."""
    block: list[str] = []
    i = index - 1
    while i >= 0 and text_lines[i].strip().startswith("#"):
        block.insert(0, text_lines[i])
        i -= 1
    return block
