"""What orchestrate does on a machine that runs ranks: find and stop a job's processes, lease
GPUs, CPU slots and ports, check a port, list the GPUs, find the interface towards the master.

One implementation for every backend that runs ranks itself. The local backend imports this
module; the SSH backend ships its source text to each host inside the agent program
(:mod:`orchestrate.backends.ssh.agent`, bundled by :mod:`orchestrate.hostside.shipping`) and runs it
there with the node's interpreter. So it uses the standard library only, runs on Python 3.8+,
and imports nothing from orchestrate.

**The tag.** Every process a launch script starts carries ``ORCHESTRATE_JOB_ID`` in its
environment, so a job's processes are found by scanning ``/proc/*/environ``, even those that left
the session (torchrun's workers, daemonised helpers). Names are never used: two jobs run the same
``python``.

**Leases.** Two jobs on one server must get disjoint GPUs, CPU slots and master ports, whichever
backend launched them. A running job records what it holds in ``<state>/leases/<hostname>/
<job_id>.json`` under an exclusive ``flock`` of that directory; planners ask first and avoid
what is held. Per host name, because home directories are often shared over NFS. A lease is live
while its holder (the process that claimed it: the local supervisor, or the SSH agent serving the
node's first rank) is alive -- checked by pid *and* start time, so a reused pid never counts --
or while any process on the host still carries the job's tag: a lease lasts as long as anything
of the job runs, even after its supervisor was killed. Anything else is stale and removed by the
next reader, so a crashed controller never blocks the GPUs for ever.

The state directory is ``$ORCHESTRATE_HOME``, else ``$XDG_STATE_HOME/orchestrate``, else
``~/.local/state/orchestrate`` (made absolute, so a supervisor started elsewhere agrees).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import time

TYPE_CHECKING = False  # typing costs milliseconds per start; the agent starts once per rank
if TYPE_CHECKING:
    from typing import Any

TAG = "ORCHESTRATE_JOB_ID"
LEASE_DIR = "leases"
SIOCGIFADDR = 0x8915


class suppress:  # contextlib.suppress, without importing contextlib's dependencies at start-up
    """Ignore the given exceptions inside a ``with`` block."""

    def __init__(self, *kinds: type[BaseException]) -> None:
        self.kinds = kinds

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, self.kinds)


def state_dir() -> str:
    """The user's orchestrate state directory, absolute, created private on first use."""
    base = os.environ.get("ORCHESTRATE_HOME")
    if not base:
        state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
        base = os.path.join(state, "orchestrate")
    path = os.path.abspath(os.path.expanduser(base))
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


# ------------------------------------------------------------------------------ processes


def proc_start(pid: int) -> int | None:
    """The start time (clock ticks since boot) of a live process; None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def alive(pid: int, start: int | None) -> bool:
    """Whether ``pid`` is still the process that started at ``start`` (None: any process)."""
    now = proc_start(pid)
    return now is not None and (start is None or now == start)


def tagged(job_id: str | None = None) -> dict[str, list[int]]:
    """Pids by job id of the live processes here carrying a tag (one scan of /proc); only
    ``job_id``'s when given. This process is never listed."""
    prefix = (TAG + "=").encode()
    me = os.getpid()
    found: dict[str, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        for item in env.split(b"\0"):
            if item.startswith(prefix):
                value = item[len(prefix):].decode(errors="replace")
                if (job_id is None or value == job_id) and proc_start(int(name)) is not None:
                    found.setdefault(value, []).append(int(name))
                break
    return found


def job_pids(job_id: str) -> list[int]:
    """The live processes of one job on this host."""
    return tagged(job_id).get(job_id, [])


def signal_all(pids: list[int], sig: int) -> None:
    """Send ``sig`` to each pid that still exists, and SIGCONT after it (a stopped process
    cannot act on SIGTERM)."""
    for pid in pids:
        for s in (sig, signal.SIGCONT) if sig != signal.SIGKILL else (sig,):
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, s)


def reap(job_id: str, grace_s: float) -> dict[str, int]:
    """Stop every process of the job here: SIGTERM (+SIGCONT), then SIGKILL whatever is left
    after ``grace_s``; then remove the job's containers here. Returns how many processes were
    found and how many needed SIGKILL."""
    pids = job_pids(job_id)
    result = {"found": len(pids), "killed": 0}
    if pids:
        signal_all(pids, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        left = pids
        while time.monotonic() < deadline:
            left = job_pids(job_id)
            if not left:
                break
            time.sleep(0.05)
        if left:
            signal_all(left, signal.SIGKILL)
            result["killed"] = len(left)
    remove_containers(job_id)
    return result


def remove_containers(job_id: str) -> int:
    """Remove the job's podman/docker containers here, found by the label the launch scripts
    give them (``orchestrate.job``, docs/containers.md): after a stop, a dead supervisor or a
    lost host's return none is left. Returns how many; a runtime that fails is skipped."""
    removed = 0
    for runtime in ("podman", "docker"):
        exe = shutil.which(runtime)
        if exe is None:
            continue
        try:
            found = subprocess.run(
                [exe, "ps", "--all", "--quiet", "--filter", f"label=orchestrate.job={job_id}"],
                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=10).stdout.split()
            if found:
                # No stop timeout: the keeper (sleep, the container's PID 1) ignores SIGTERM,
                # and the ranks inside were stopped above.
                now = ["--time=0"] if runtime == "podman" else []
                subprocess.run([exe, "rm", "--force", *now, *found], stdin=subprocess.DEVNULL,
                               capture_output=True, timeout=60)
                removed += len(found)
        except (OSError, subprocess.SubprocessError):
            continue
    return removed


def watch(pid: int, start: int | None, job_id: str, grace_s: float, poll_s: float = 0.25) -> int:
    """Wait for process ``pid`` (started at ``start``) to end, then stop whatever the job left
    here and drop its lease. A watchdog beside a supervisor: if the supervisor is killed (even
    with SIGKILL) its ranks do not outlive it. Returns the number of processes it stopped."""
    while alive(pid, start):
        time.sleep(poll_s)
    stopped = reap(job_id, grace_s)["found"]
    with suppress(OSError):
        LeaseBook().release(job_id)
    return stopped


# ------------------------------------------------------------------------------ leases


def new_lease(job_id: str, node: str, gpus: list[int], slots: int, port: int | None,
              holder_pid: int) -> dict[str, Any]:
    """A lease record: what ``job_id`` holds on this host, and who holds it."""
    return {
        "job_id": job_id, "node": node, "hostname": socket.gethostname(),
        "gpus": sorted(set(gpus)), "slots": int(slots), "port": port,
        "holder_pid": holder_pid, "holder_start": proc_start(holder_pid), "created": time.time(),
    }


def held(leases: list[dict[str, Any]]) -> dict[str, Any]:
    """What a set of leases holds together: GPUs, CPU slots, ports, and by which jobs."""
    return {
        "gpus": sorted({int(g) for lease in leases for g in lease.get("gpus") or []}),
        "slots": sum(int(lease.get("slots") or 0) for lease in leases),
        "ports": sorted({int(lease["port"]) for lease in leases if lease.get("port") is not None}),
        "jobs": sorted({str(lease["job_id"]) for lease in leases}),
    }


class LeaseBook:
    """The lease files of this host (see the module docstring)."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory or os.path.join(state_dir(), LEASE_DIR, socket.gethostname())
        os.makedirs(self.directory, mode=0o700, exist_ok=True)

    def locked(self) -> _Locked:
        """``with book.locked(): ...`` holds the book's exclusive lock."""
        return _Locked(os.path.join(self.directory, ".lock"))

    def _path(self, job_id: str) -> str:
        return os.path.join(self.directory, job_id + ".json")

    def live(self, except_job: str | None = None) -> list[dict[str, Any]]:
        """Leases of jobs that still hold something (call inside :meth:`locked`); stale ones
        are deleted. ``except_job``'s own lease is left out."""
        leases = []
        for name in sorted(os.listdir(self.directory)):
            if not name.endswith(".json"):
                continue
            path = os.path.join(self.directory, name)
            try:
                with open(path) as f:
                    lease = json.load(f)
                holder = int(lease["holder_pid"])
                job = str(lease["job_id"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if job != except_job:
                leases.append((path, lease, holder))
        jobs = None
        live = []
        for path, lease, holder in leases:
            ok = alive(holder, lease.get("holder_start"))
            if not ok:
                jobs = tagged() if jobs is None else jobs
                ok = str(lease["job_id"]) in jobs
            if ok:
                live.append(lease)
            else:
                with suppress(OSError):
                    os.unlink(path)
        return live

    def record(self, lease: dict[str, Any]) -> None:
        """Write a lease (call inside :meth:`locked`), atomically."""
        path = self._path(str(lease["job_id"]))
        with open(path + ".tmp", "w") as f:
            json.dump(lease, f)
        os.replace(path + ".tmp", path)

    def claim(self, lease: dict[str, Any], slot_capacity: int | None = None) -> dict[str, Any]:
        """Record ``lease`` unless another live job holds one of its GPUs or its port, the port
        cannot be bound, or the CPU slots would exceed ``slot_capacity``. Returns ``{"ok":
        True}``, or ``{"ok": False, ...}`` with what the others hold."""
        with self.locked():
            others = held(self.live(except_job=str(lease["job_id"])))
            busy_gpus = sorted(set(lease.get("gpus") or []) & set(others["gpus"]))
            port = lease.get("port")
            port_taken = port is not None and (port in others["ports"] or not port_free(port))
            slots = int(lease.get("slots") or 0)
            too_many = slot_capacity is not None and slots and \
                others["slots"] + slots > slot_capacity
            if busy_gpus or port_taken or too_many:
                return {"ok": False, "busy_gpus": others["gpus"], "busy_ports": others["ports"],
                        "busy_slots": others["slots"], "port_taken": port_taken,
                        "jobs": others["jobs"]}
            self.record(lease)
        return {"ok": True}

    def release(self, job_id: str) -> None:
        """Drop ``job_id``'s lease on this host (nothing if it has none)."""
        with self.locked(), suppress(FileNotFoundError):
            os.unlink(self._path(job_id))


class _Locked:
    """An exclusive ``flock`` on a file, as a context manager."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> None:
        self.handle = open(self.path, "a+")
        fcntl.flock(self.handle, fcntl.LOCK_EX)

    def __exit__(self, *_: object) -> None:
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()


# ------------------------------------------------------------------------------ checks


def port_free(port: int) -> bool:
    """Whether a TCP port can be bound on every interface here (SO_REUSEADDR, as torch's
    TCPStore binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def run_text(argv: list[str], timeout: float = 20.0) -> str:
    """A command's standard output; raises on failure, a timeout or a missing program."""
    return subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=True, text=True,
    ).stdout


def gpus() -> dict[str, Any]:
    """The GPUs ``nvidia-smi`` lists, in its order (PCI bus order): ``{"ok": True, "present":
    [[index, name, memory_mib], ...]}``, or ``{"ok": False, "detail": why}``. No nvidia-smi
    means no GPUs, said as such.

    The SSH agent's check that a plan's GPU indices exist on its host, nothing more: what a GPU
    *is* (model, memory, link) is read in one place, :mod:`orchestrate.probe.facts` from
    :mod:`orchestrate.hostside.hostfacts`, for local planning, inventory files and the doctor
    alike."""
    try:
        out = run_text(["nvidia-smi", "--query-gpu=index,name,memory.total",
                        "--format=csv,noheader,nounits"])
    except FileNotFoundError:
        return {"ok": False, "missing": True, "detail": "nvidia-smi not found on PATH"}
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        return {"ok": False, "detail": f"nvidia-smi failed: {str(detail).strip()[-300:]}"}
    present = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if parts and parts[0].isdigit():
            try:
                mib = float(parts[2]) if len(parts) > 2 else 0.0
            except ValueError:
                mib = 0.0
            present.append([int(parts[0]), parts[1] if len(parts) > 1 else "?", mib])
    return {"ok": True, "present": present}


def interface_towards(address: str) -> dict[str, Any]:
    """The interface that carries traffic to ``address``: ``ip route get`` names it, except on
    the host owning the address (``local ... dev lo``), where it is the interface holding it."""
    try:
        ip = str(socket.getaddrinfo(address, None, socket.AF_INET)[0][4][0])
    except OSError as exc:
        return {"ok": False, "detail": f"cannot resolve {address}: {exc}"}
    try:
        words = run_text(["ip", "-o", "route", "get", ip]).split()
        if words and words[0] == "local":
            owner = run_text(["ip", "-o", "-4", "addr", "show", "to", ip + "/32"]).split()
            words = ["dev", owner[1]]
        name = words[words.index("dev") + 1].split("@")[0]
        return {"ok": True, "name": name, "ip": ip}
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        pass
    # No iproute2: the source address the kernel picks towards ip, and who owns it.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((ip, 9))
            source = probe.getsockname()[0]
            for _, name in socket.if_nameindex():
                request = struct.pack("256s", name.encode()[:15])
                with suppress(OSError):
                    answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
                    if socket.inet_ntoa(answer[20:24]) == source:
                        return {"ok": True, "name": name, "ip": ip}
    except OSError as exc:
        return {"ok": False, "detail": f"no route to {ip}: {exc}"}
    return {"ok": False, "detail": f"no interface found towards {ip}"}


__all__ = [
    "TAG", "LeaseBook", "alive", "gpus", "held", "interface_towards", "job_pids", "new_lease",
    "port_free", "proc_start", "reap", "run_text", "signal_all", "state_dir", "tagged", "watch",
]
