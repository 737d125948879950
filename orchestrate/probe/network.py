"""What a host's network facts mean: its interfaces, its HCAs, and the network DDP should use.

From the sysfs part of :func:`orchestrate.hostside.hostfacts.gather` (``/sys/class/net``,
``/sys/class/infiniband``) and the routes to the other nodes: an interface is physical,
InfiniBand (IPoIB), virtual, a bridge or the loopback; an HCA port is active or not, with its
rate and link layer. :func:`choose_network` picks the interface the routes to the other nodes
leave by (never a bridge such as docker0, nor loopback) and its fabric from the HCAs behind it.
Pure: dicts in, values out.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from orchestrate.core.spec.inventory import NetworkSpec


@dataclass(frozen=True)
class NicFact:
    """One network interface from sysfs."""

    name: str
    operstate: str | None
    speed_mbps: int | None
    mtu: int | None
    kind: Literal["physical", "infiniband", "virtual", "bridge", "loopback"]
    addresses: tuple[str, ...] = ()

    @property
    def up(self) -> bool:
        """Whether the link carries traffic."""
        return self.operstate == "up"


@dataclass(frozen=True)
class HcaPort:
    """One port of an InfiniBand/RoCE HCA."""

    hca: str
    port: int | None
    active: bool
    state: str | None
    gbps: float | None
    link_layer: str | None
    netdevs: tuple[str, ...] = ()



def nics_of(raw: list[dict[str, Any]]) -> tuple[NicFact, ...]:
    out = []
    for item in raw:
        name = str(item.get("name", ""))
        kind: Literal["physical", "infiniband", "virtual", "bridge", "loopback"]
        if item.get("type") == 772 or name == "lo":
            kind = "loopback"
        elif item.get("bridge"):
            kind = "bridge"
        elif item.get("type") == 32:  # ARPHRD_INFINIBAND: an IPoIB interface
            kind = "infiniband"
        elif item.get("physical"):
            kind = "physical"
        else:
            kind = "virtual"
        speed = item.get("speed_mbps")
        out.append(NicFact(
            name=name,
            operstate=item.get("operstate"),
            speed_mbps=int(speed) if isinstance(speed, int | float) and speed > 0 else None,
            mtu=item.get("mtu"),
            kind=kind,
            addresses=tuple(item.get("addresses") or ()),
        ))
    return tuple(out)


def _rate_gbps(rate: str | None) -> float | None:
    """``400 Gb/sec (4X NDR)`` -> 400."""
    found = re.match(r"^\s*([\d.]+)\s*Gb/sec", rate or "")
    return float(found.group(1)) if found else None


def hcas_of(raw: list[dict[str, Any]]) -> tuple[HcaPort, ...]:
    out = []
    for hca in raw:
        for port in hca.get("ports") or []:
            state = port.get("state")
            out.append(HcaPort(
                hca=str(hca.get("name")),
                port=port.get("port"),
                active="ACTIVE" in str(state or "").upper(),
                state=state,
                gbps=_rate_gbps(port.get("rate")),
                link_layer=port.get("link_layer"),
                netdevs=tuple(hca.get("netdevs") or ()),
            ))
    return tuple(out)


def _whole(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def choose_network(
    nics: tuple[NicFact, ...], hcas: tuple[HcaPort, ...], routes: Mapping[str, str]
) -> tuple[NetworkSpec | None, str]:
    """The network DDP should use, and a note on how it was chosen.

    The interface is the one the routes to the other nodes leave by (most peers win); a bridge
    (docker0) or loopback there is refused. Without usable routes it is the fastest physical
    interface that is up (InfiniBand first). Active InfiniBand ports make the fabric
    ``infiniband`` with their HCAs, whatever carries the bootstrap traffic (else NCCL would be
    told to leave IB alone); an HCA port with an Ethernet link layer behind the chosen interface
    makes it ``roce``.
    """
    by_name = {n.name: n for n in nics}
    note = ""
    chosen: NicFact | None = None
    counts = Counter(routes.values())
    for name, _ in counts.most_common():
        nic = by_name.get(name)
        if nic is None:
            note = f"the route to the other nodes leaves by {name}, which sysfs does not list"
            continue
        if nic.kind == "loopback":
            continue  # the peers are this host
        if nic.kind == "bridge":
            note = (f"the route to the other nodes goes through the bridge {name} "
                    "(a container network?); not used")
            continue
        chosen = nic
        note = f"{name} carries the route to the other nodes"
        break
    if chosen is None:
        candidates = [n for n in nics if n.kind in ("physical", "infiniband") and n.up]
        if any(n.addresses for n in nics):
            candidates = [n for n in candidates if n.addresses] or candidates
        candidates.sort(key=lambda n: (n.kind != "infiniband", -(n.speed_mbps or 0), n.name))
        if not candidates:
            return None, note or "no physical network interface is up"
        chosen = candidates[0]
        note = (note + "; " if note else "") + f"{chosen.name}: the fastest physical interface up"
    ib = [p for p in hcas if p.active and (p.link_layer or "").lower() == "infiniband"]
    if ib:
        names = list(dict.fromkeys(p.hca for p in ib))
        gbps = next((p.gbps for p in ib if chosen.name in p.netdevs and p.gbps), None)
        gbps = gbps or next((p.gbps for p in ib if p.gbps), None)
        return NetworkSpec(
            interface=chosen.name, fabric="infiniband",
            gbps=None if gbps is None else _whole(gbps), hca=",".join(names),
        ), note
    roce = [p for p in hcas if p.active and chosen.name in p.netdevs
            and (p.link_layer or "").lower() == "ethernet"]
    if roce:
        gbps = (chosen.speed_mbps / 1000 if chosen.speed_mbps else None) or roce[0].gbps
        return NetworkSpec(
            interface=chosen.name, fabric="roce",
            gbps=None if gbps is None else _whole(gbps), hca=roce[0].hca,
        ), note
    gbps = chosen.speed_mbps / 1000 if chosen.speed_mbps else None
    return NetworkSpec(
        interface=chosen.name, fabric="ethernet", gbps=None if gbps is None else _whole(gbps)
    ), note
