"""What the GPUs' own health counters and the kernel log say about them, gathered where they run.

A sick GPU (uncorrectable memory errors, a page or row waiting to be retired, a link trained at
x4, a card held in a hardware slowdown, one that fell off the bus) turns a week-long job into a
hang or a crawl. As a plain user on a mixed server, ``nvidia-smi`` (NVML) is what there is (DCGM
runs only its quickest level on RTX A6000-class cards), so this module asks it the health fields
in one bounded ``--query-gpu`` call, run and read as :mod:`orchestrate.hostside.smi` runs every
one, and reads the ``Xid`` lines of the kernel log where this user may (``dmesg``, else
``journalctl -k -b``; unreadable is said, never fatal). It only *collects*: the verdicts are
:mod:`orchestrate.core.gpuhealth`'s, on the controller, so recorded outputs replay through the
same rules. Standard library only, Python 3.8+ (run by the local supervisor, shipped inside the
SSH agent).

:func:`gather` returns a JSON-able dict::

    status      "ok" | "missing" (no nvidia-smi: no GPUs) | "failed"
    error       why not, or None
    fields      the fields asked, under their current names (old names mapped back)
    dropped     fields this driver does not know (left out; their checks are not made)
    gpus        [{field: raw cell}] per GPU, ``[N/A]``/``[Not Supported]`` kept as printed
    kernel_log  {"readable": bool, "source": "dmesg" | "journalctl -k" | None,
                 "xid": [the Xid lines since boot], "detail": why unreadable, or None}
    seconds     how long gathering took
"""

from __future__ import annotations

import os
import re
import time

from orchestrate.hostside.smi import NO_STATUS, message, query, run, said
from orchestrate.hostside.smicsv import rows

TYPE_CHECKING = False  # typing costs start-up time on every host; only the checker needs it
if TYPE_CHECKING:
    from typing import Any

#: The fields asked (``nvidia-smi --help-query-gpu`` of drivers 535-570). ``index`` first:
#: every row is keyed by it.
HEALTH_FIELDS = (
    "index", "pci.bus_id", "name",
    "ecc.errors.uncorrected.volatile.total", "ecc.errors.uncorrected.aggregate.total",
    "retired_pages.pending", "remapped_rows.pending", "remapped_rows.failure",
    "clocks_event_reasons.hw_slowdown", "clocks_event_reasons.hw_thermal_slowdown",
    "clocks_event_reasons.hw_power_brake_slowdown",
    "pcie.link.gen.current", "pcie.link.gen.max",
    "pcie.link.width.current", "pcie.link.width.max", "persistence_mode",
)
#: Drivers before 535 call the clock reasons ``clocks_throttle_reasons.*``.
NEW_REASONS = "clocks_event_reasons."
OLD_REASONS = "clocks_throttle_reasons."
#: How long one ``nvidia-smi`` or kernel-log read may take.
HEALTH_TIMEOUT_S = float(os.environ.get("ORCHESTRATE_NVIDIA_SMI_TIMEOUT_S") or 10.0)
LOG_TIMEOUT_S = 5.0
_UNKNOWN_FIELD = re.compile(r'Field "([^"]+)" is not a valid field to query')
#: What marks a kernel log line as an Xid: ``NVRM: Xid (PCI:0000:01:00): 79, pid=..., GPU has
#: fallen off the bus.`` (read by :mod:`orchestrate.core.gpuhealth`).
XID_MARK = "NVRM: Xid ("
#: At most this many Xid lines come back (the newest): a flapping GPU logs thousands.
XID_LINES = 200


def gather(timeout_s: float = HEALTH_TIMEOUT_S, kernel_log: bool = True) -> dict[str, Any]:
    """The GPUs' health fields and the kernel log's Xid lines (the shape in the docstring)."""
    began = time.monotonic()
    report = ask(timeout_s)
    if kernel_log and report["status"] == "ok":
        report["kernel_log"] = xid_lines()
    else:
        report["kernel_log"] = {"readable": False, "source": None, "xid": [],
                                "detail": "not read (no GPUs answered)"}
    report["seconds"] = round(time.monotonic() - began, 3)
    return report


def ask(timeout_s: float = HEALTH_TIMEOUT_S) -> dict[str, Any]:
    """The health query alone: with the old clock-reason names when the driver refuses the new
    ones, without any other field it does not know (each refusal names one; a few tries)."""
    wanted = list(HEALTH_FIELDS)
    asked = list(wanted)
    dropped: list[str] = []
    for _ in range(6):
        answer = query("gpu", asked, timeout_s)
        if answer["status"] == "ok":
            names = [_current(f) for f in asked]
            return {"status": "ok", "error": None, "fields": names, "dropped": dropped,
                    "gpus": rows(answer["text"] or "", names)}
        unknown = _UNKNOWN_FIELD.search(str(answer.get("error") or ""))
        if answer["status"] != "failed" or unknown is None or unknown.group(1) not in asked:
            return {"status": answer["status"], "error": said(answer), "fields": [],
                    "dropped": dropped, "gpus": []}
        field = unknown.group(1)
        if field.startswith(NEW_REASONS):  # an older driver: the old names, all of them
            asked = [OLD_REASONS + f[len(NEW_REASONS):] if f.startswith(NEW_REASONS) else f
                     for f in asked]
            continue
        asked.remove(field)
        dropped.append(_current(field))
    return {"status": "failed", "error": "nvidia-smi refused the health fields: "
            + ", ".join(dropped), "fields": [], "dropped": dropped, "gpus": []}


def _current(field: str) -> str:
    """A field under its current name: ``clocks_throttle_reasons.x`` as
    ``clocks_event_reasons.x``."""
    if field.startswith(OLD_REASONS):
        return NEW_REASONS + field[len(OLD_REASONS):]
    return field


def xid_lines(timeout_s: float = LOG_TIMEOUT_S) -> dict[str, Any]:
    """The kernel log's Xid lines since boot, from ``dmesg`` or (where the kernel restricts it
    to root, ``kernel.dmesg_restrict``) ``journalctl -k -b`` (readable by the ``adm`` and
    ``systemd-journal`` groups); when neither can be read, which and why."""
    tried = []
    for source, argv in (("dmesg", ["dmesg"]),
                         ("journalctl -k", ["journalctl", "-k", "-b", "-q", "--no-pager",
                                            "-o", "short-monotonic"])):
        code, out, err = run(argv, timeout_s)
        if code == 0:
            found = [line.strip() for line in out.splitlines() if XID_MARK in line]
            return {"readable": True, "source": source, "xid": found[-XID_LINES:],
                    "detail": None}
        why = "not installed" if code is None else message(code, out, err)
        if code == NO_STATUS and not why:
            why = "did not answer"
        tried.append(f"{source}: {why.splitlines()[-1] if why else why}")
    return {"readable": False, "source": None, "xid": [],
            "detail": "the kernel log is not readable here (" + "; ".join(tried) + ")"}


__all__ = ["HEALTH_FIELDS", "XID_MARK", "ask", "gather", "xid_lines"]
