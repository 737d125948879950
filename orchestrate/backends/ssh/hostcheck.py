"""The SSH agent's preflight: every check of its host in one go, as the ranks will see it.

One ``preflight`` request answers everything the controller judges a plan by
(:mod:`orchestrate.backends.ssh.preflight`): the node's python, the torch (and the command's
orchestrate module) its path finds as the ranks will, torch's version read without importing
it, the working directory, the
interface towards MASTER_ADDR and whether it resolves, the GPUs and which of them processes
outside orchestrate use, what other jobs hold in the host's lease book and who waits before
this job, and which master ports can be bound. It only *finds*; the answer is one
:class:`~orchestrate.backends.ssh.facts.HostFacts`, checked field by field as it is made.
Standard library only, Python 3.8+: part of the agent program
(:data:`orchestrate.backends.ssh.channels.AGENT`).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading

from orchestrate.backends.ssh.facts import HostFacts
from orchestrate.backends.ssh.wire import Preflight
from orchestrate.hostside.fairshare import growth
from orchestrate.hostside.fairshare import use as fair_use
from orchestrate.hostside.gpuhealth import gather as gather_health
from orchestrate.hostside.gpuuse import outside_use, usage
from orchestrate.hostside.host import interface_towards, port_free
from orchestrate.hostside.leases import BookError, LeaseBook, describe, held
from orchestrate.hostside.masterreach import resolve

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

TORCH_TIMEOUT_S = 240.0
TORCH_VERSION = "orchestrate-torch-version "
#: The probe: the torch the ranks' path finds, and its version, read from its ``version.py``
#: without importing it (``import torch`` took 1-3 s a host, most of the preflight); a torch
#: without that file (or an unreadable one) is imported, as the ranks would. Then the command's
#: orchestrate module is looked for on the same path.
_PROBE = """import importlib.util, os, re
spec = importlib.util.find_spec("torch")
version = None
for folder in (spec.submodule_search_locations or []) if spec else []:
    try:
        with open(os.path.join(folder, "version.py")) as f:
            found = re.search(r"^__version__\\s*=\\s*[\\x27\\x22]([^\\x27\\x22]+)", f.read(), re.M)
    except OSError:
        found = None
    version = found.group(1) if found else None
    break
if version is None:
    import torch
    version = torch.__version__
print("\\n" + TAG + version, flush=True)
"""


def _torch_probe(request: Preflight) -> tuple[subprocess.Popen[str] | None, str | None]:
    """Start looking for torch and its version (and the command's orchestrate module) as the
    ranks will: the node's python (a wrapper may set its own path), the job's PYTHONPATH, its
    working directory. The probe running, or why it could not start."""
    if not request.torch:
        return None, None
    # The version on a line of its own (an import may print warnings first), flushed before a
    # later import's traceback reaches the shared pipe.
    probe = _PROBE.replace("TAG", repr(TORCH_VERSION))
    module = request.orchestrate
    if module:  # the module the command runs, found where the ranks will look
        name = module if re.match(r"^[\w.]+$", module) else "orchestrate.train"
        probe += (f"if importlib.util.find_spec({name!r}) is None:\n"
                  f"    raise ModuleNotFoundError(\"No module named '{name}'\")\n")
    python = request.python or sys.executable
    env = dict(os.environ)
    if request.pythonpath is not None:
        env["PYTHONPATH"] = request.pythonpath
    workdir = request.workdir
    try:
        return subprocess.Popen(
            [python, "-c", probe], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, universal_newlines=True, env=env,
            cwd=workdir if os.path.isdir(workdir) else None,
        ), None
    except OSError as exc:
        return None, f"cannot run {python}: {exc.strerror or exc}"


def preflight(request: Preflight) -> HostFacts:
    """Every check of this host; facts, the controller judges them against the plan."""
    torch, failed = _torch_probe(request)
    facts: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "python": sys.executable + " " + sys.version.split()[0],
        "cpus": os.cpu_count(),
        "workdir": {"ok": os.path.isdir(request.workdir), "path": request.workdir},
    }
    if request.interface_to:
        facts["interface"] = interface_towards(request.interface_to)
    if request.master_addr:
        facts["master"] = resolve(request.master_addr)
    # The health query and the kernel log are read while the use queries run: nvidia-smi's
    # start (the driver's, without persistence mode) is paid once in wall time, not twice.
    health = _started(gather_health) if request.gpus and request.health else None
    found = usage() if request.gpus else None
    if found is not None:
        facts["gpus"] = present(found)
    if health is not None:
        answer = health()
        if found is not None and found.get("ok"):
            facts["gpu_health"] = answer
    try:
        book = LeaseBook(request.lease_dir)
        with book.locked():
            leases = held(book.live(except_job=request.job_id))
            leases["queue"] = [describe(t) for t in book.ahead(request.want or {},
                                                                request.job_id)]
            leases["use"] = fair_use(book).get(os.geteuid(), 0.0)  # gang order
            leases["use_rate"] = growth(book)
            leases["problems"] = book.problems
    except (BookError, OSError) as exc:
        leases = {"error": str(exc), "hint": getattr(exc, "hint", ""),
                  "busy": bool(getattr(exc, "busy", False))}
    facts["leases"] = leases
    if found is not None:
        facts["gpu_use"] = outside_use(found, set(leases.get("gpus") or []))
    if request.ports:
        facts["ports"] = {"free": [p for p in request.ports if port_free(p)],
                          "tried": len(request.ports)}
    if failed is not None:
        facts["torch"] = {"ok": False, "detail": failed}
    if torch is not None:
        facts["torch"] = _imported(torch)
    return HostFacts.from_json(facts)


def _started(work: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """``work`` started in a thread now; the call returned waits for its answer (a gathering
    that raised answers as one that failed, said, not fatal)."""
    box: list[dict[str, Any]] = []

    def run() -> None:
        try:
            box.append(work())
        except Exception as exc:  # any failure is an answer here
            box.append({"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                        "gpus": [], "kernel_log": {"readable": False, "xid": []}})

    thread = threading.Thread(target=run, name="orchestrate-health", daemon=True)
    thread.start()

    def answer() -> dict[str, Any]:
        thread.join()
        return box[0]

    return answer


def _imported(torch: subprocess.Popen[str]) -> dict[str, Any]:
    """What the torch probe found: its version, or what it said last."""
    try:
        out, _ = torch.communicate(timeout=TORCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        torch.kill()
        return {"ok": False, "detail": f"import took over {TORCH_TIMEOUT_S:.0f}s"}
    lines = out.strip().splitlines()
    version = next((line[len(TORCH_VERSION):] for line in lines
                    if line.startswith(TORCH_VERSION)), None)
    ok = torch.returncode == 0 and version is not None
    said = [line for line in lines if line.strip() and not line.startswith(TORCH_VERSION)]
    return {"ok": ok, "version": version,
            "detail": version if ok else (said[-1] if said else f"exit {torch.returncode}")}


def present(found: dict[str, Any]) -> dict[str, Any]:
    """Which GPUs nvidia-smi lists (the plan's must be there): ``{"ok": True, "present":
    [[index, nvidia-smi's name, memory MiB], ...]}``, or ``{"ok": False, "detail": why}``."""
    if not found.get("ok"):
        return {"ok": False, "missing": bool(found.get("missing")), "detail": found["detail"]}
    return {"ok": True, "present": [[g["index"], g["name"], g["memory_total_mib"] or 0.0]
                                    for g in found["gpus"]]}
