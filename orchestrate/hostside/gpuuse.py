"""What the GPUs here are doing right now: memory used, utilization, and the compute processes on
each (``nvidia-smi --query-compute-apps``), whoever started them.

A lab server's GPUs are used outside orchestrate too (another user's notebook, a script run by
hand): a GPU with a compute process that no orchestrate job of this machine holds by lease is
*in use*, and planning leaves it alone unless the job shares (``resources.share_gpus``), and
then it counts the GPU's free memory, not its total. What a GPU *is* (model, total memory,
links) is :mod:`orchestrate.hostside.hostfacts`' business; this module asks only what changes
from one minute to the next, in two bounded ``nvidia-smi`` calls. Standard library only,
Python 3.8+ (shipped inside the SSH agent).
"""

from __future__ import annotations

import os
import subprocess

from orchestrate.hostside.containment import command_name, live_survivors, owner_uid, user_name

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: How long one ``nvidia-smi`` call may take before it counts as hung.
SMI_TIMEOUT_S = float(os.environ.get("ORCHESTRATE_NVIDIA_SMI_TIMEOUT_S") or 5.0)
GPU_QUERY = "index,uuid,pci.bus_id,name,memory.total,memory.used,utilization.gpu"
#: process_name last: it is the one field that may hold a comma.
APP_QUERY = "pid,used_memory,gpu_uuid,gpu_bus_id,process_name"
#: Memory in use on a GPU with no compute process listed (processes of another PID namespace,
#: a container) above which it counts as in use.
UNSEEN_MIB = 1024.0


def _smi(query: str, timeout_s: float) -> str:
    return subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader,nounits"], stdin=subprocess.DEVNULL,
        capture_output=True, timeout=timeout_s, check=True, text=True,
    ).stdout


def _number(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None  # [N/A], [Not Supported]


def bus_key(bus: str | None) -> str:
    """A PCI bus id as both queries print it, compared without the domain's zero padding."""
    parts = (bus or "").strip().lower().split(":")
    if len(parts) != 3:
        return ":".join(parts)
    try:
        domain = int(parts[0], 16)
    except ValueError:
        return ":".join(parts)
    return f"{domain:x}:{parts[1]}:{parts[2]}"


def usage(timeout_s: float = SMI_TIMEOUT_S) -> dict[str, Any]:
    """``{"ok": True, "gpus": [...], "apps": [...]}`` or ``{"ok": False, "detail": why}``
    (``missing`` when there is no nvidia-smi: no GPUs)."""
    try:
        gpus = _gpus(_smi("--query-gpu=" + GPU_QUERY, timeout_s))
        apps = _apps(_smi("--query-compute-apps=" + APP_QUERY, timeout_s), gpus)
    except FileNotFoundError:
        return {"ok": False, "missing": True, "detail": "nvidia-smi not found on PATH"}
    except subprocess.TimeoutExpired:
        return {"ok": False, "detail": f"nvidia-smi did not answer within {timeout_s:g}s"}
    except subprocess.CalledProcessError as exc:
        said = " ".join(f"{exc.stdout or ''} {exc.stderr or ''}".split())[-300:]
        return {"ok": False, "detail": f"nvidia-smi failed (exit {exc.returncode}): {said}"}
    except OSError as exc:
        return {"ok": False, "detail": f"nvidia-smi failed: {exc}"}
    return {"ok": True, "gpus": gpus, "apps": apps}


def _gpus(text: str) -> list[dict[str, Any]]:
    found = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 7 or not cells[0].isdigit():
            continue
        found.append({"index": int(cells[0]), "uuid": cells[1], "bus_id": cells[2],
                      "model": cells[3], "memory_total_mib": _number(cells[4]),
                      "memory_used_mib": _number(cells[5]), "utilization_pct": _number(cells[6])})
    return found


def _apps(text: str, gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_uuid = {g["uuid"]: g["index"] for g in gpus if g["uuid"] and g["uuid"][:1] != "["}
    by_bus = {bus_key(g["bus_id"]): g["index"] for g in gpus}
    found = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",", 4)]
        if len(cells) < 5 or not cells[0].isdigit():
            continue
        pid = int(cells[0])
        index = by_uuid.get(cells[2], by_bus.get(bus_key(cells[3])))
        if index is None:
            continue
        uid = owner_uid(pid)
        name = cells[4] if cells[4][:1] not in ("", "[") else command_name(pid)
        found.append({"pid": pid, "gpu": index, "memory_mib": _number(cells[1]),
                      "name": os.path.basename(name), "uid": uid, "user": user_name(uid)})
    return found


def gb(mib: float | None) -> float:
    """MiB as nvidia-smi counts them, in GB as orchestrate shows GPU memory (1024 MiB)."""
    return round((mib or 0.0) / 1024.0, 1)


def outside_use(found: dict[str, Any], leased: set[int]) -> dict[str, dict[str, Any]]:
    """GPUs in use outside every orchestrate job here: ``index -> {"why", "free_gb"}``, where
    ``leased`` are the GPUs jobs hold (their processes are theirs)."""
    if not found.get("ok"):
        return {}
    busy: dict[str, dict[str, Any]] = {}
    for gpu in found["gpus"]:
        index = int(gpu["index"])
        if index in leased:
            continue
        apps = [a for a in found["apps"] if a["gpu"] == index]
        used = gpu.get("memory_used_mib")
        total = gpu.get("memory_total_mib")
        if apps:
            why = ", ".join(f"pid {a['pid']} ({a['user']}, {a['name']}, "
                            f"{gb(a['memory_mib']):.1f} GB)" for a in apps)
        elif used is not None and used > UNSEEN_MIB:
            why = f"{gb(used):.1f} GB used by processes not visible here"
        else:
            continue
        if used is None:
            used = sum(a["memory_mib"] or 0.0 for a in apps)
        free = None if total is None else max(0.0, gb(total) - gb(used))
        busy[str(index)] = {"why": f"GPU {index} in use by {why}", "free_gb": free}
    return busy


def holders(found: dict[str, Any], leases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every GPU with its holders, as ``orchestrate gpus`` shows them: the orchestrate jobs
    leasing it and the compute processes on it (each with the job it belongs to, if any)."""
    owners: dict[int, list[dict[str, Any]]] = {}
    for lease in leases:
        for index in lease.get("gpus") or []:
            owners.setdefault(int(index), []).append(lease)
    rows = []
    for gpu in found.get("gpus", []):
        index = int(gpu["index"])
        jobs = owners.get(index, [])
        held = [{"kind": "job", "user": lease.get("user"), "job_id": lease.get("job_id"),
                 "pid": None, "name": None, "memory_gb": None,
                 "since": lease.get("since") or lease.get("created"),
                 "survivors": [{"pid": pid, "user": user_name(owner_uid(pid)),
                                "name": command_name(pid)}
                               for pid in live_survivors(lease.get("survivors"))]}
                for lease in jobs]
        for app in found.get("apps", []):
            if app["gpu"] == index:
                job = jobs[0].get("job_id") if len(jobs) == 1 else None
                held.append({"kind": "process", "user": app["user"], "job_id": job,
                             "pid": app["pid"], "name": app["name"],
                             "memory_gb": gb(app["memory_mib"]), "since": None})
        rows.append({"index": index, "model": gpu["model"],
                     "memory_total_gb": gb(gpu["memory_total_mib"]),
                     "memory_used_gb": None if gpu["memory_used_mib"] is None
                     else gb(gpu["memory_used_mib"]),
                     "utilization_pct": gpu["utilization_pct"], "holders": held})
    return rows


__all__ = ["SMI_TIMEOUT_S", "bus_key", "gb", "holders", "outside_use", "usage"]
