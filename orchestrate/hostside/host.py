"""What orchestrate does on a machine that runs ranks: find and stop a job's processes, check a
port, list the GPUs, find the interface towards the master.

One implementation for every backend that runs ranks itself. The local backend imports this
module; the SSH backend ships its source text to each host inside the agent program
(:mod:`orchestrate.backends.ssh.agent`, bundled by :mod:`orchestrate.hostside.shipping`) and runs it
there with the node's interpreter. So it uses the standard library only, runs on Python 3.8+,
and imports nothing from orchestrate.

**The tag.** Every process a launch script starts carries ``ORCHESTRATE_JOB_ID`` in its
environment, so a job's processes are found by scanning ``/proc/*/environ``, even those that left
the session (torchrun's workers, daemonised helpers). Names are never used: two jobs run the same
``python``. A process that drops the tag is still found by ancestry or its cgroup
(:mod:`orchestrate.hostside.containment`).

The lease book every user of the machine shares is :mod:`orchestrate.hostside.leases`; the
watchdog beside a local supervisor is :mod:`orchestrate.hostside.watchdog`.

The state directory is ``$ORCHESTRATE_HOME``, else ``$XDG_STATE_HOME/orchestrate``, else
``~/.local/state/orchestrate`` (made absolute, so a supervisor started elsewhere agrees).
"""

from __future__ import annotations

import fcntl
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


def reap(job_id: str, grace_s: float, containers: bool = True) -> dict[str, int]:
    """Stop every process of the job here: SIGTERM (+SIGCONT), then SIGKILL whatever is left
    after ``grace_s``; then remove the job's containers here, unless the caller knows the job
    runs in none (``containers`` False: asking podman and docker took 0.15-0.45 s at the end of
    every job). Returns how many processes were found and how many needed SIGKILL."""
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
    if containers:
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
                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60).stdout.split()
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
    "TAG", "alive", "interface_towards", "job_pids", "port_free", "proc_start", "reap",
    "run_text", "signal_all", "state_dir", "suppress", "tagged",
]
