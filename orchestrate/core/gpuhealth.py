"""The verdict on each GPU's health: fail (no rank is placed on it), warn (slower or suspect), or
pass, each finding in one sentence a person can act on.

Pure: the facts :mod:`orchestrate.hostside.gpuhealth` gathered on a host (nvidia-smi's health
fields, the kernel log's Xid lines) in, one :class:`GpuVerdict` per GPU out, so the local
supervisor, the SSH launcher, the doctor and ``orchestrate gpus`` judge alike, and recorded
outputs of sick GPUs replay through the very rules a submit applies. What is noise is decided
here, once (reference: shared/reference/gpu-health-and-placement.md):

- the PCIe *generation* drops at idle by design (power saving): never a finding; the *width*
  does not: a link below its maximum width is a reseat or a riser (warn);
- a volatile uncorrectable ECC count is since the driver loaded: suspect (warn) on its own; a
  page waiting to be retired or a row waiting to be remapped needs a reset (fail); a failed
  row remap needs a new GPU (fail); the lifetime (aggregate) count alone is history;
- a hardware slowdown (``hw_slowdown``, thermal, power brake) makes the GPU a straggler (warn);
- persistence mode off is a slow first start, not a fault (no finding);
- Xid lines since boot: 48 (double-bit ECC), 64 (retirement or remap failed), 79 (fallen off the
  bus), 95 (uncontained ECC) fail; 63 (a page retired or row remapped), 74 (NVLink), 92 (a high
  single-bit rate), 94 (contained ECC), 119/120 (GSP) warn; an application's Xid (13, 31, 43...)
  is the program's, not the GPU's;
- a GPU the inventory lists that nvidia-smi does not: fallen off the bus (fail).

Standard library only (the kernel's and nvidia-smi's words, nothing else); nvidia-smi's cells
are read by :mod:`orchestrate.hostside.smicsv`, as every gatherer reads them (pure: the core
loads no process code).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from orchestrate.hostside.smicsv import number, value

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from typing import Any

FAIL = "fail"
WARN = "warn"
PASS = "pass"
#: Xid -> (severity, what it means): NVIDIA's Xid catalogue, the hardware ones.
XIDS = {
    48: (FAIL, "a double-bit ECC error (Xid 48)"),
    63: (WARN, "a page retired or row remapped (Xid 63)"),
    64: (FAIL, "a page retirement or row remap that failed (Xid 64)"),
    74: (WARN, "an NVLink error (Xid 74)"),
    79: (FAIL, "fell off the bus (Xid 79)"),
    92: (WARN, "a high single-bit ECC error rate (Xid 92)"),
    94: (WARN, "a contained ECC error (Xid 94)"),
    95: (FAIL, "an uncontained ECC error (Xid 95)"),
    119: (WARN, "a GSP timeout (Xid 119)"),
    120: (WARN, "a GSP error (Xid 120)"),
}
_SLOWDOWNS = (("clocks_event_reasons.hw_slowdown", "a hardware slowdown"),
              ("clocks_event_reasons.hw_thermal_slowdown", "a thermal slowdown"),
              ("clocks_event_reasons.hw_power_brake_slowdown", "a power-brake slowdown"))
UNTIL = "until then orchestrate will not place ranks on it"
#: ``NVRM: Xid (PCI:0000:01:00): 79, pid=..., GPU has fallen off the bus.``: the bus, the Xid.
XID = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+)[^)]*\): (\d+)")


@dataclass(frozen=True)
class Finding:
    """One thing wrong with a GPU: its severity, what was seen, and what to do."""

    severity: str
    seen: str
    action: str


@dataclass(frozen=True)
class GpuVerdict:
    """One GPU's health: ``status`` fail/warn/pass, and its findings."""

    index: int
    model: str
    bus_id: str
    findings: tuple[Finding, ...] = field(default_factory=tuple)

    @property
    def status(self) -> str:
        severities = {f.severity for f in self.findings}
        return FAIL if FAIL in severities else WARN if severities else PASS

    @property
    def line(self) -> str:
        """The sentence a person reads: "GPU 5 (RTX A6000, 00000000:C1:00.0): 2 uncorrectable
        ECC errors since boot and 1 row remap pending: reboot the server to remap; until then
        orchestrate will not place ranks on it"."""
        if not self.findings:
            return f"GPU {self.index} ({self.model}, {self.bus_id}): healthy"
        ordered = sorted(self.findings, key=lambda f: f.severity != FAIL)
        actions = list(dict.fromkeys(f.action for f in ordered))
        tail = [UNTIL] if self.status == FAIL else []
        return (f"GPU {self.index} ({self.model}, {self.bus_id}): "
                + " and ".join(f.seen for f in ordered) + ": " + "; ".join(actions + tail))

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "model": self.model, "bus_id": self.bus_id,
                "status": self.status, "line": self.line,
                "findings": [{"severity": f.severity, "seen": f.seen, "action": f.action}
                             for f in self.findings]}


@dataclass(frozen=True)
class HostHealth:
    """Every GPU's verdict on one host, and what could not be checked (said, not failed)."""

    gpus: tuple[GpuVerdict, ...]
    notes: tuple[str, ...] = ()

    def sick(self) -> dict[int, str]:
        """GPUs no rank may be placed on: index -> the sentence that says why."""
        return {g.index: g.line for g in self.gpus if g.status == FAIL}

    def warnings(self) -> list[str]:
        return [g.line for g in self.gpus if g.status == WARN]

    def to_json(self) -> dict[str, Any]:
        return {"gpus": [g.to_json() for g in self.gpus], "notes": list(self.notes)}


def judge(facts: Mapping[str, Any], expected: Iterable[int] = ()) -> HostHealth:
    """The verdict on every GPU of ``facts`` (:func:`orchestrate.hostside.gpuhealth.gather`);
    ``expected``: the CUDA indices the inventory lists here (one nvidia-smi lacks failed)."""
    notes = []
    if facts.get("status") != "ok":
        if facts.get("status") == "failed":
            notes.append(f"GPU health not checked: {facts.get('error')}")
        return HostHealth((), tuple(notes))
    dropped = list(facts.get("dropped") or [])
    if dropped:
        notes.append("this driver does not report " + ", ".join(dropped)
                     + ": those checks were not made")
    log = facts.get("kernel_log") or {}
    if not log.get("readable"):
        notes.append(str(log.get("detail") or "the kernel log was not read")
                     + ": Xid errors not checked")
    xids = _xids_by_bus(log.get("xid") or [])
    verdicts = []
    for row in facts.get("gpus") or []:
        if not str(row.get("index", "")).isdigit():
            continue
        found = _row_findings(row) + _xid_findings(xids.get(_bus(row.get("pci.bus_id")), []))
        verdicts.append(GpuVerdict(int(row["index"]), _model(row.get("name")),
                                   str(row.get("pci.bus_id") or "?"), tuple(found)))
    listed = {v.index for v in verdicts}
    for index in sorted(set(expected) - listed):
        verdicts.append(GpuVerdict(index, "?", "?", (Finding(
            FAIL, "listed in the inventory but not by nvidia-smi (fallen off the bus?)",
            "reboot the server, or reseat the GPU if it stays missing"),)))
    return HostHealth(tuple(sorted(verdicts, key=lambda v: v.index)), tuple(notes))


def _row_findings(row: Mapping[str, str]) -> list[Finding]:
    found = []
    volatile = number(row.get("ecc.errors.uncorrected.volatile.total"))
    retire = _yes(row.get("retired_pages.pending"))
    remap = _yes(row.get("remapped_rows.pending"))
    retire_action = "reboot the server (or reset the GPU) to retire the page"
    remap_action = "reboot the server (or reset the GPU) to remap"
    if volatile:
        count = int(volatile)
        action = (remap_action if remap else retire_action if retire
                  else "reset the GPU (or reboot) to clear them; if they come back, "
                  "tell the server's admin")
        found.append(Finding(FAIL if retire or remap else WARN,
                             f"{count} uncorrectable ECC error{'s' if count != 1 else ''} "
                             "since boot", action))
    if retire:
        found.append(Finding(FAIL, "a page retirement pending", retire_action))
    if remap:
        found.append(Finding(FAIL, "a row remap pending", remap_action))
    if _yes(row.get("remapped_rows.failure")):
        found.append(Finding(FAIL, "a row remap that failed",
                             "the GPU should be replaced: tell the server's admin"))
    for name, what in _SLOWDOWNS:
        if (value(row.get(name)) or "").lower() == "active":
            found.append(Finding(WARN, f"held in {what}",
                                 "check its cooling and power (ranks on it run slower)"))
    width, widest = (number(row.get("pcie.link.width.current")),
                     number(row.get("pcie.link.width.max")))
    if width and widest and width < widest:
        found.append(Finding(WARN, f"a PCIe link at x{int(width)} of x{int(widest)}",
                             "reseat the card or check its riser (transfers run slower)"))
    return found


def _xid_findings(codes: list[int]) -> list[Finding]:
    found = []
    for code in sorted(set(codes)):
        known = XIDS.get(code)
        if known is not None:
            times = codes.count(code)
            found.append(Finding(known[0], known[1] + (f" x{times}" if times > 1 else "")
                                 + " since boot", "reboot the server; if it comes back, "
                                 "tell the server's admin"))
    return found


def _xids_by_bus(lines: Iterable[str]) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for line in lines:
        match = XID.search(line)
        if match:
            found.setdefault(_bus(match.group(1)), []).append(int(match.group(2)))
    return found


def _bus(text: object) -> str:
    """``00000000:C1:00.0`` (nvidia-smi) and ``0000:c1:00`` (the kernel's Xid) alike:
    ``0:c1:00``."""
    parts = str(text or "").strip().lower().split(".")[0].split(":")
    if len(parts) != 3:
        return ":".join(parts)
    try:
        return f"{int(parts[0], 16):x}:{int(parts[1], 16):02x}:{int(parts[2], 16):02x}"
    except ValueError:
        return ":".join(parts)


def _yes(cell: str | None) -> bool:
    """A Yes/No field, or a count: yes when Yes or above zero."""
    text = (value(cell) or "").lower()
    if text in ("yes", "true", "active"):
        return True
    found = number(text) if text else None
    return bool(found)


def _model(name: str | None) -> str:
    text = value(name) or "?"
    return text[len("NVIDIA "):] if text.startswith("NVIDIA ") else text


def bus_key(text: object) -> str:
    """A PCI bus id as one key, whoever wrote it (nvidia-smi ``00000000:C1:00.0``, the driver's
    ``0000:c1:00.0``, the kernel's ``0000:c1:00``): which GPUs a Slurm job was given."""
    return _bus(text)


def sick_on(health: Mapping[str, Any]) -> dict[int, str]:
    """The sick GPUs of a :meth:`HostHealth.to_json` document: index -> sentence."""
    return {int(g["index"]): str(g["line"]) for g in health.get("gpus") or []
            if g.get("status") == FAIL}


__all__ = ["FAIL", "PASS", "WARN", "XIDS", "Finding", "GpuVerdict", "HostHealth", "bus_key",
           "judge", "sick_on"]
