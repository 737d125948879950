"""What the GPUs here are doing right now: memory used, utilization, and the compute processes on
each (``nvidia-smi --query-compute-apps``), whoever started them.

A lab server's GPUs are used outside orchestrate too (another user's notebook, a script run by
hand): a GPU with a compute process that no orchestrate job of this machine holds by lease is
*in use*, and planning leaves it alone unless the job shares (``resources.share_gpus``), and
then it counts the GPU's free memory, not its total. What a GPU *is* (model, total memory,
links) is :mod:`orchestrate.hostside.hostfacts`' business; this module asks only what changes
from one minute to the next, in two bounded ``nvidia-smi`` calls, run and read as
:mod:`orchestrate.hostside.smi` runs and reads every one. Standard library only, Python 3.8+
(shipped inside the SSH agent).
"""

from __future__ import annotations

import os

from orchestrate.hostside.containment import command_name, live_survivors, owner_uid, user_name
from orchestrate.hostside.smi import query, said
from orchestrate.hostside.smicsv import number, rows, value

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from orchestrate.hostside.leaserecord import Lease

#: How long one ``nvidia-smi`` call may take before it counts as hung.
SMI_TIMEOUT_S = float(os.environ.get("ORCHESTRATE_NVIDIA_SMI_TIMEOUT_S") or 5.0)
GPU_FIELDS = ("index", "uuid", "pci.bus_id", "name", "memory.total", "memory.used",
              "utilization.gpu")
#: process_name last: it is the one field that may hold a comma.
APP_FIELDS = ("pid", "used_memory", "gpu_uuid", "gpu_bus_id", "process_name")
#: Memory in use on a GPU with no compute process listed (processes of another PID namespace,
#: a container) above which it counts as in use.
UNSEEN_MIB = 1024.0


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
    (``missing`` when there is no nvidia-smi: no GPUs). A GPU's ``name`` is nvidia-smi's own
    (``NVIDIA A100 80GB PCIe``); the model a job names comes from
    :func:`orchestrate.probe.facts.normalise_model`."""
    gpus = query("gpu", GPU_FIELDS, timeout_s)
    apps = query("compute-apps", APP_FIELDS, timeout_s) if gpus["status"] == "ok" else gpus
    if apps["status"] != "ok":
        return {"ok": False, "missing": apps["status"] == "missing", "detail": said(apps)}
    found = _gpus(rows(gpus["text"], GPU_FIELDS))
    return {"ok": True, "gpus": found, "apps": _apps(rows(apps["text"], APP_FIELDS), found)}


def _gpus(listed: list[dict[str, str]]) -> list[dict[str, Any]]:
    return [{"index": int(row["index"]), "uuid": row["uuid"], "bus_id": row["pci.bus_id"],
             "name": row["name"], "memory_total_mib": number(row["memory.total"]),
             "memory_used_mib": number(row["memory.used"]),
             "utilization_pct": number(row["utilization.gpu"])}
            for row in listed if row["index"].isdigit()]


def _apps(listed: list[dict[str, str]], gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_uuid = {g["uuid"]: g["index"] for g in gpus if value(g["uuid"])}
    by_bus = {bus_key(g["bus_id"]): g["index"] for g in gpus}
    found = []
    for row in listed:
        if not row["pid"].isdigit():
            continue
        pid = int(row["pid"])
        index = by_uuid.get(row["gpu_uuid"], by_bus.get(bus_key(row["gpu_bus_id"])))
        if index is None:
            continue
        uid = owner_uid(pid)
        name = row["process_name"] if row["process_name"][:1] not in ("", "[") \
            else command_name(pid)
        found.append({"pid": pid, "gpu": index, "memory_mib": number(row["used_memory"]),
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


def command_line(pid: int, limit: int = 40) -> str:
    """``python train.py``: a process's program (its file name) and arguments, shortened;
    its command name when ``/proc/PID/cmdline`` cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read(4096).decode(errors="replace").split("\0")
    except OSError:
        words = []
    words = [w for w in words if w]
    if not words:
        return command_name(pid)
    text = " ".join([os.path.basename(words[0]), *words[1:]])
    return text if len(text) <= limit else text[:limit - 3] + "..."


def foreign_use(found: dict[str, Any], leases: list[Lease]) -> list[dict[str, Any]]:
    """Compute processes of another user on GPUs a job leases: each with the job, its owner
    and ``line``, what the job's owner is told ("GPU 3 of your job j1 is also used by pid
    4242 (ben, python train.py, 12.0 GB)"). A process of the job's own user counts as the
    job's (another user's environment cannot be read to tell)."""
    if not found.get("ok"):
        return []
    uses = []
    for lease in leases:
        for app in found["apps"]:
            if app["gpu"] in lease.gpus and app["uid"] is not None and app["uid"] != lease.uid:
                what = command_line(app["pid"])
                uses.append({"gpu": app["gpu"], "job_id": lease.job_id, "owner": lease.user,
                             "pid": app["pid"], "user": app["user"], "name": what,
                             "memory_gb": gb(app["memory_mib"]),
                             "line": f"GPU {app['gpu']} of {lease.user}'s job {lease.job_id} "
                             f"is also used by pid {app['pid']} ({app['user']}, {what}, "
                             f"{gb(app['memory_mib']):.1f} GB)"})
    return uses


def told(found: dict[str, Any], lease: Lease) -> dict[int, str]:
    """What the job's owner is told, by pid: "GPU 3 of your job is also used by pid 4242
    (ben, python train.py, 12.0 GB)" (the local supervisor and the SSH agent look alike)."""
    return {use["pid"]: f"GPU {use['gpu']} of your job is also used by pid {use['pid']} "
            f"({use['user']}, {use['name']}, {use['memory_gb']:.1f} GB)"
            for use in foreign_use(found, [lease])}


def holders(found: dict[str, Any], leases: list[Lease]) -> list[dict[str, Any]]:
    """Every GPU with its holders, as ``orchestrate gpus`` shows them: the orchestrate jobs
    leasing it and the compute processes on it (each with the job it belongs to, if any: one of
    the job's user; another user's process is ``foreign``, beside the job, not of it)."""
    owners: dict[int, list[Lease]] = {}
    for lease in leases:
        for index in lease.gpus:
            owners.setdefault(index, []).append(lease)
    table = []
    for gpu in found.get("gpus", []):
        index = int(gpu["index"])
        jobs = owners.get(index, [])
        held = [{"kind": "job", "user": lease.user, "job_id": lease.job_id,
                 "pid": None, "name": None, "memory_gb": None, "since": lease.since or None,
                 "survivors": [{"pid": pid, "user": user_name(owner_uid(pid)),
                                "name": command_name(pid)}
                               for pid in live_survivors([list(p) for p in lease.survivors])]}
                for lease in jobs]
        for app in found.get("apps", []):
            if app["gpu"] == index:
                mine = [lease for lease in jobs if lease.uid == app["uid"]]
                held.append({"kind": "process", "user": app["user"],
                             "job_id": mine[0].job_id if len(mine) == 1 else None,
                             "foreign": bool(jobs) and not mine,
                             "pid": app["pid"], "name": app["name"],
                             "memory_gb": gb(app["memory_mib"]), "since": None})
        table.append({"index": index, "name": gpu["name"],
                     "memory_total_mib": gpu["memory_total_mib"],
                     "memory_total_gb": gb(gpu["memory_total_mib"]),
                     "memory_used_gb": None if gpu["memory_used_mib"] is None
                     else gb(gpu["memory_used_mib"]),
                     "utilization_pct": gpu["utilization_pct"], "holders": held})
    return table


__all__ = ["SMI_TIMEOUT_S", "bus_key", "command_line", "foreign_use", "gb", "holders",
           "outside_use", "told", "usage"]
