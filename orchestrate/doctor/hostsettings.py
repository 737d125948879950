"""The host settings behind NCCL's freezes in containers, judged from what the host says. Pure.

The field notes' Docker freeze was fixed *outside* the container: two RTX A6000s hung until the
host's IOMMU was disabled (pytorch #73790); NCCL #2079 is the same with PCIe ACS. NCCL's
troubleshooting guide ("PCI Access Control Services (ACS)") says why: IOMMU and ACS can redirect
all PCI peer-to-peer traffic to the CPU root complex, "causing a significant performance
reduction or even a hang". So, on GPU nodes, the doctor reads (docs/containers.md, docs/doctor.md):

- ``/proc/cmdline`` and ``/sys/class/iommu``: an IOMMU that is on (the folder lists a unit, or
  ``intel_iommu=on``/``amd_iommu=on``) without passthrough (``iommu=pt``,
  ``iommu.passthrough=1``) warns: boot with ``iommu=pt`` or turn VT-d/AMD-Vi off in the BIOS;
- ``lspci -vvv``: ``ACSCtl: SrcValid+`` on the bridges above the planned GPUs (a bridge whose
  secondary..subordinate bus range holds a GPU's bus) warns: turn ACS off in the BIOS, boot with
  ``pci=noacs`` where the kernel has it, or ``setpci -s BRIDGE ECAP_ACS+6.w=0000`` (NCCL's
  guide). Without the bridges' bus lines (``lspci -vvv | grep ACSCtl``), every SrcValid+ counts;
  ``Capabilities: <access denied>`` (lspci not run as root) says ACS is unknown;
- the kernel log: ``AMD-Vi ... IO_PAGE_FAULT`` and ``DMAR ... fault`` lines name the IOMMU
  faulting the GPUs' DMA.

Each finding is a warning (the job can still run; it may hang or crawl) that says what to change
and where to read more. What was not gathered gives no row.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrate.doctor.grading import Check

READ_MORE = "docs/containers.md#host-settings (NCCL troubleshooting: PCI ACS)"
_DEVICE = re.compile(r"^(?:([0-9a-f]{4}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])\s", re.I)
_BUS = re.compile(r"Bus:\s*primary=([0-9a-f]+),\s*secondary=([0-9a-f]+),\s*subordinate=([0-9a-f]+)",
                  re.I)
_FAULT = re.compile(r"(AMD-Vi:.*IO_PAGE_FAULT|IO_PAGE_FAULT|DMAR:.*fault|DMAR:\s*\[DMA)", re.I)
_FAULT_DEVICE = re.compile(r"(?:device=|\s)((?:[0-9a-f]{4}:)?[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])", re.I)


@dataclass(frozen=True)
class HostSettings:
    """What the host says, raw (each None where it was not gathered)."""

    cmdline: str | None = None
    iommu_units: tuple[str, ...] | None = None  # the entries of /sys/class/iommu
    lspci: str | None = None  # `lspci -vvv` (or only its ACSCtl lines)
    kernel_log: str | None = None  # `dmesg` or `journalctl -k`
    gpu_bus_ids: tuple[str, ...] = field(default_factory=tuple)  # "0000:07:00.0", planned GPUs

    def to_json(self) -> dict[str, Any]:
        """A JSON value (the doctor's facts)."""
        return {"cmdline": self.cmdline, "iommu_units": None if self.iommu_units is None
                else list(self.iommu_units), "lspci": self.lspci,
                "kernel_log": self.kernel_log, "gpu_bus_ids": list(self.gpu_bus_ids)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HostSettings:
        """The value :meth:`to_json` wrote."""
        units = data.get("iommu_units")
        return cls(cmdline=data.get("cmdline"),
                   iommu_units=None if units is None else tuple(str(u) for u in units),
                   lspci=data.get("lspci"), kernel_log=data.get("kernel_log"),
                   gpu_bus_ids=tuple(str(b) for b in data.get("gpu_bus_ids") or ()))


def judge_host_settings(node: str, host: HostSettings) -> list[Check]:
    """The IOMMU, ACS and IOMMU-fault rows of one GPU node (none for what was not gathered)."""
    rows = [_iommu(node, host), _acs(node, host), _faults(node, host)]
    return [row for row in rows if row is not None]


def _words(cmdline: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for word in cmdline.split():
        key, _, value = word.partition("=")
        out[key] = value
    return out


def _iommu(node: str, host: HostSettings) -> Check | None:
    if host.cmdline is None and host.iommu_units is None:
        return None
    words = _words(host.cmdline or "")
    asked_on = any(words.get(k) == "on" for k in ("intel_iommu", "amd_iommu"))
    asked_off = any(words.get(k) == "off" for k in ("intel_iommu", "amd_iommu")) or \
        words.get("iommu") == "off"
    on = (bool(host.iommu_units) or asked_on) and not asked_off
    passthrough = words.get("iommu") == "pt" or words.get("iommu.passthrough") == "1"
    measured = ("off" if not on else "on, passthrough" if passthrough else "on, translating")
    if not on or passthrough:
        return Check("static", "IOMMU", (node,), "pass", f"IOMMU on {node}: {measured}",
                     measured=measured, expected="off or passthrough (iommu=pt)")
    units = ", ".join(host.iommu_units or ()) or "the kernel command line"
    return Check(
        "static", "IOMMU", (node,), "warn",
        f"IOMMU is on without passthrough on {node} ({units}): GPU peer-to-peer traffic goes "
        "through the CPU root complex, which slows NCCL or hangs it (pytorch #73790)",
        measured=measured, expected="off or passthrough (iommu=pt)",
        hint=f"boot {node} with iommu=pt on the kernel command line (or turn VT-d/AMD-Vi off "
        f"in the BIOS); read more: {READ_MORE}")


@dataclass
class _Port:
    address: str
    acs_on: bool = False
    acs_seen: bool = False
    buses: tuple[int, int] | None = None  # secondary, subordinate


def _ports(lspci: str) -> tuple[list[_Port], bool]:
    """Each device of ``lspci -vvv`` (or one per ACSCtl line when headers are missing), and
    whether some capabilities were hidden (lspci without root)."""
    ports: list[_Port] = []
    current: _Port | None = None
    denied = False
    for line in lspci.splitlines():
        match = _DEVICE.match(line)
        if match:
            current = _Port(f"{match.group(1) or '0000'}:{match.group(2)}:{match.group(3)}."
                            f"{match.group(4)}".lower())
            ports.append(current)
            continue
        denied = denied or "<access denied>" in line
        bus = _BUS.search(line)
        if bus and current is not None:
            current.buses = (int(bus.group(2), 16), int(bus.group(3), 16))
        if "ACSCtl:" in line:
            if current is None or current.acs_seen:
                current = _Port("?")
                ports.append(current)
            current.acs_seen = True
            current.acs_on = "SrcValid+" in line
    return ports, denied


def _above(port: _Port, buses: Sequence[int]) -> bool:
    """Whether a GPU's bus is in the port's secondary..subordinate range."""
    return port.buses is not None and any(port.buses[0] <= b <= port.buses[1] for b in buses)


def _gpu_bus(bus_id: str) -> int | None:
    match = re.search(r"([0-9a-f]{2}):[0-9a-f]{2}\.[0-7]$", bus_id.lower())
    return int(match.group(1), 16) if match else None


def _acs(node: str, host: HostSettings) -> Check | None:
    if host.lspci is None:
        return None
    ports, denied = _ports(host.lspci)
    on = [p for p in ports if p.acs_on]
    buses = [b for b in map(_gpu_bus, host.gpu_bus_ids) if b is not None]
    located = [p for p in on if p.buses is not None]
    if buses and located:  # the bridges above the planned GPUs
        on = [p for p in located if _above(p, buses)]
    if not any(p.acs_seen for p in ports):
        if not denied:
            return Check("static", "PCIe ACS", (node,), "pass",
                         f"no PCIe port with Access Control Services on {node}")
        return Check("static", "PCIe ACS", (node,), "warn",
                     f"PCIe ACS unknown on {node}: lspci could not read the capabilities",
                     hint="run the doctor as root (lspci -vvv shows ACSCtl only to root)")
    if not on:
        return Check("static", "PCIe ACS", (node,), "pass",
                     f"PCIe ACS off above the GPUs on {node}",
                     measured="SrcValid-", expected="SrcValid- (ACS off)")
    named = [p.address for p in on if p.address != "?"]
    where = (f"on {', '.join(named[:4])}{' ...' if len(named) > 4 else ''}" if named
             else f"on {len(on)} PCIe port(s)")
    return Check(
        "static", "PCIe ACS", (node,), "warn",
        f"PCIe ACS is enabled (ACSCtl SrcValid+) {where} of {node}: it redirects GPU "
        "peer-to-peer traffic to the root complex, which slows NCCL or hangs it (NCCL #2079)",
        measured="SrcValid+", expected="SrcValid- (ACS off)",
        hint="turn ACS off in the BIOS, boot with pci=noacs where the kernel has it, or run "
        f"setpci -s BRIDGE ECAP_ACS+6.w=0000 after each boot; read more: {READ_MORE}")


def _faults(node: str, host: HostSettings) -> Check | None:
    if host.kernel_log is None:
        return None
    lines = [ln for ln in host.kernel_log.splitlines() if _FAULT.search(ln)]
    if not lines:
        return Check("static", "IOMMU faults", (node,), "pass",
                     f"no IOMMU page faults in {node}'s kernel log")
    devices = sorted({m.group(1).lower() for ln in lines for m in [_FAULT_DEVICE.search(ln)]
                      if m is not None})
    return Check(
        "static", "IOMMU faults", (node,), "warn",
        f"{len(lines)} IOMMU page fault(s) in {node}'s kernel log"
        + (f" (devices {', '.join(devices[:4])})" if devices else "")
        + ": the IOMMU is refusing device DMA, which GPU peer-to-peer and RDMA need",
        measured=lines[-1].strip()[:160], expected="none",
        hint=f"boot {node} with iommu=pt (or amd_iommu=off/intel_iommu=off), or turn the "
        f"IOMMU off in the BIOS; read more: {READ_MORE}")


def host_settings_rows(facts: Mapping[str, HostSettings], gpu_nodes: Sequence[str]
                       ) -> list[Check]:
    """The rows of every GPU node that has host settings."""
    return [row for name in gpu_nodes if name in facts
            for row in judge_host_settings(name, facts[name])]


__all__ = ["HostSettings", "host_settings_rows", "judge_host_settings"]
