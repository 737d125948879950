"""The program orchestrate runs on every SSH host, sent as ``python -c SOURCE MODE [ARGS]``.

Standard library only, Python 3.8+: it runs under the node's interpreter (inventory ``python``),
before anything of ours is installed there. Two modes:

``serve`` runs on a pty channel, one per rank. It sets the pty raw (no echo: secrets written to
stdin never come back in the output; no line editing or signal characters), says ``ready``, then
obeys one JSON request per stdin line, answering each on stdout as a line
``<RS>orchestrate:<kind> <json>``:

- ``preflight``: every check of this host in one go (python, torch, workdir, master port,
  network interface towards MASTER_ADDR, GPUs by nvidia-smi, the leases other jobs hold);
- ``claim``: record this job's GPUs and port in the host's lease book, under flock, unless another
  live job holds them (then say which);
- ``files``: write the run directory's files (0700 directory, 0600/0700 files);
- ``start``: run ``bash launch-<node>.sh LOCAL_RANK`` as a child that inherits the pty, say its
  pid, wait for it, say how it ended and exit the same way;
- ``abort``: release the claim and exit; nothing was started.

The serving process stays the session leader of the pty. When the channel closes (the
controller died, or stopped the job) it gets SIGHUP and stops every process of the job on this
host by tag before it exits, so nothing outlives a vanished controller.

``reap JOB_ID GRACE_S`` runs without a pty: SIGTERM (+SIGCONT) to every process whose environment
carries ``ORCHESTRATE_JOB_ID=JOB_ID``, SIGKILL to what is left after GRACE_S, then it drops the
job's lease on this host and prints one JSON line.

Leases live in ``$ORCHESTRATE_HOME/leases/<hostname>/`` (default
``~/.local/state/orchestrate``): per host name, because home directories are often shared over
NFS. A lease is live while the process that claimed it (the serving process of local rank 0,
which lives as long as that rank) is alive, checked by pid and start time so a reused pid never
counts, or while any process on the host carries the job's tag; a stale lease is removed by the
next reader, so a crashed controller never blocks GPUs for ever.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

TYPE_CHECKING = False  # typing costs a few ms per start; the agent starts once per rank
if TYPE_CHECKING:
    from typing import IO, Any

MARK = "\x1eorchestrate:"


class suppress:  # contextlib.suppress, without importing collections at start-up
    """Ignore the given exceptions inside a ``with`` block."""

    def __init__(self, *kinds: type[BaseException]) -> None:
        self.kinds = kinds

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, self.kinds)

TAG = "ORCHESTRATE_JOB_ID"
TORCH_TIMEOUT_S = 240.0
SIOCGIFADDR = 0x8915


def say(kind: str, payload: Any) -> None:
    """One protocol line on stdout (all of it, even on a slow pty)."""
    data = (MARK + kind + " " + json.dumps(payload) + "\n").encode()
    while data:
        written = os.write(1, data)
        data = data[written:]


class Requests:
    """Request lines from stdin, read in chunks; the controller never sends ahead of a reply,
    so nothing after a request line (the secrets after ``start``) is ever swallowed."""

    def __init__(self) -> None:
        self.buffer = b""

    def next(self) -> dict[str, Any] | None:
        while b"\n" not in self.buffer:
            try:
                chunk = os.read(0, 65536)
            except OSError:
                return None
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        request: dict[str, Any] = json.loads(line.decode())
        return request


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


def tagged(job_id: str | None = None) -> dict[str, list[int]]:
    """Pids by job id of every process here carrying an ORCHESTRATE_JOB_ID (one /proc scan)."""
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


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        for s in (sig, signal.SIGCONT) if sig != signal.SIGKILL else (sig,):
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, s)


def reap(job_id: str, grace_s: float) -> dict[str, int]:
    """SIGTERM every process of the job here, SIGKILL what is left after ``grace_s``."""
    pids = tagged(job_id).get(job_id, [])
    if not pids:
        return {"found": 0, "killed": 0}
    signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    left = pids
    while time.monotonic() < deadline:
        left = tagged(job_id).get(job_id, [])
        if not left:
            return {"found": len(pids), "killed": 0}
        time.sleep(0.05)
    signal_all(left, signal.SIGKILL)
    return {"found": len(pids), "killed": len(left)}


# ------------------------------------------------------------------------------ leases


def lease_dir() -> str:
    base = os.environ.get("ORCHESTRATE_HOME")
    if not base:
        state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
        base = os.path.join(state, "orchestrate")
    path = os.path.join(os.path.expanduser(base), "leases", socket.gethostname())
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


class lease_lock:  # used like a function: ``with lease_lock() as directory``
    """The host's lease directory, held under an exclusive flock."""

    def __enter__(self) -> str:
        directory = lease_dir()
        self.lock = open(os.path.join(directory, ".lock"), "a+")
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        return directory

    def __exit__(self, *_: object) -> None:
        fcntl.flock(self.lock, fcntl.LOCK_UN)
        self.lock.close()


def live_leases(directory: str, except_job: str) -> list[dict[str, Any]]:
    """Leases of other jobs that still hold something; stale ones are deleted."""
    leases = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path) as f:
                lease = json.load(f)
            holder, started = int(lease["holder_pid"]), lease["holder_start"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if lease.get("job_id") == except_job:
            continue
        leases.append((path, lease, holder, started))
    if not leases:
        return []
    jobs = None
    live = []
    for path, lease, holder, started in leases:
        alive = proc_start(holder) == started
        if not alive:
            jobs = tagged() if jobs is None else jobs
            alive = lease["job_id"] in jobs
        if alive:
            live.append(lease)
        else:
            with suppress(OSError):
                os.unlink(path)
    return live


def held(leases: list[dict[str, Any]]) -> dict[str, list[Any]]:
    gpus = sorted({g for lease in leases for g in lease.get("gpus", [])})
    ports = sorted({lease["port"] for lease in leases if lease.get("port") is not None})
    return {"gpus": gpus, "ports": ports, "jobs": sorted({str(x["job_id"]) for x in leases})}


def release(job_id: str) -> None:
    with lease_lock() as directory, suppress(OSError):
        os.unlink(os.path.join(directory, job_id + ".json"))


# ------------------------------------------------------------------------------ checks


def port_free(port: int) -> bool:
    """Whether a TCP port can be bound on every interface here (SO_REUSEADDR, like TCPStore)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def run_text(argv: list[str], timeout: float = 20.0) -> str:
    return subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=True,
        text=True,
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


def gpus_present() -> dict[str, Any]:
    try:
        out = run_text(["nvidia-smi", "--query-gpu=index,name,memory.total",
                        "--format=csv,noheader,nounits"])
    except FileNotFoundError:
        return {"ok": False, "detail": "nvidia-smi not found on PATH"}
    except (OSError, subprocess.SubprocessError) as exc:
        return {"ok": False, "detail": f"nvidia-smi failed: {exc}"}
    present = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if parts and parts[0].isdigit():
            present.append([int(parts[0]), parts[1] if len(parts) > 1 else "?"])
    return {"ok": True, "present": present}


def preflight(request: dict[str, Any]) -> dict[str, Any]:
    """Every check of this host; facts, the controller judges them against the plan."""
    torch: subprocess.Popen[str] | None = None
    if request.get("torch"):
        probe = "import torch; print(torch.__version__)"
        if request.get("orchestrate"):
            probe += "; import orchestrate.train"
        torch = subprocess.Popen(
            [sys.executable, "-c", probe], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )
    report: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "python": sys.executable + " " + sys.version.split()[0],
        "workdir": {"ok": os.path.isdir(request["workdir"]), "path": request["workdir"]},
    }
    if request.get("interface_to"):
        report["interface"] = interface_towards(request["interface_to"])
    if request.get("gpus"):
        report["gpus"] = gpus_present()
    try:
        with lease_lock() as directory:
            report["leases"] = held(live_leases(directory, request["job_id"]))
    except OSError as exc:
        report["leases"] = {"error": str(exc), "gpus": [], "ports": [], "jobs": []}
    candidates = request.get("ports") or []
    if candidates:
        report["ports"] = {"free": [p for p in candidates if port_free(p)],
                           "tried": len(candidates)}
    if torch is not None:
        try:
            out, _ = torch.communicate(timeout=TORCH_TIMEOUT_S)
            lines = out.strip().splitlines()
            report["torch"] = {"ok": torch.returncode == 0,
                               "detail": lines[0] if torch.returncode == 0 and lines
                               else (lines[-1] if lines else f"exit {torch.returncode}")}
        except subprocess.TimeoutExpired:
            torch.kill()
            report["torch"] = {"ok": False, "detail": f"import took over {TORCH_TIMEOUT_S:.0f}s"}
    return report


# ------------------------------------------------------------------------------ serving


class Serving:
    """State of one serve channel."""

    def __init__(self) -> None:
        self.job_id = ""
        self.claimed = False
        self.grace_s = 5.0

    def claim(self, request: dict[str, Any]) -> dict[str, Any]:
        self.job_id = request["job_id"]
        gpus, port = set(request.get("gpus") or []), request.get("port")
        with lease_lock() as directory:
            others = held(live_leases(directory, self.job_id))
            busy_gpus = sorted(gpus & set(others["gpus"]))
            port_taken = port is not None and (port in others["ports"] or not port_free(port))
            if busy_gpus or port_taken:
                return {"ok": False, "busy_gpus": others["gpus"], "busy_ports": others["ports"],
                        "port_taken": port_taken}
            lease = {
                "job_id": self.job_id, "node": request.get("node"),
                "hostname": socket.gethostname(), "gpus": sorted(gpus), "port": port,
                "holder_pid": os.getpid(), "holder_start": proc_start(os.getpid()),
                "created": time.time(),
            }
            path = os.path.join(directory, self.job_id + ".json")
            with open(path + ".tmp", "w") as f:
                json.dump(lease, f)
            os.replace(path + ".tmp", path)
        self.claimed = True
        return {"ok": True}

    def unclaim(self) -> None:
        if self.claimed:
            with suppress(OSError):
                release(self.job_id)
            self.claimed = False

    def files(self, request: dict[str, Any]) -> dict[str, Any]:
        run_dir = request["run_dir"]
        os.umask(0o077)
        try:
            os.makedirs(run_dir, mode=0o700, exist_ok=True)
            os.chmod(run_dir, 0o700)
            for name, text in request["files"].items():
                path = os.path.join(run_dir, name)
                tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"  # shared file systems
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(text)
                os.chmod(tmp, 0o700 if name.endswith(".sh") else 0o600)
                os.replace(tmp, path)
        except OSError as exc:
            return {"ok": False, "detail": f"{exc.strerror}: {exc.filename}"}
        return {"ok": True}

    def hangup(self, signum: int, _frame: object) -> None:
        """The channel closed under us: stop the job's processes here, then go."""
        with suppress(Exception):
            if self.job_id:
                reap(self.job_id, self.grace_s)
            self.unclaim()
        os._exit(128 + signum)

    def start(self, request: dict[str, Any]) -> int:
        self.job_id = request["job_id"]
        self.grace_s = float(request.get("grace_s", 5.0))
        # Tagged from its first instruction: the script exports the tag too, but /proc/*/environ
        # shows the environment a process was exec'd with, so kill-by-tag would otherwise miss
        # the script until it execs the rank.
        env = dict(os.environ, **{TAG: self.job_id})
        child = subprocess.Popen(["bash", request["script"], str(request["local_rank"])],
                                 cwd=os.path.dirname(request["script"]), env=env)
        say("pid", {"pid": child.pid})
        while True:
            try:
                _, status = os.waitpid(child.pid, 0)
                break
            except ChildProcessError:
                status = 255 << 8
                break
        result: dict[str, int]
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            result, code = {"signal": sig}, 128 + sig
        else:
            code = os.WEXITSTATUS(status)
            result = {"code": code}
        # Nothing of the job left here: drop its lease (whoever holds it) and say so, so the
        # controller need not come back to sweep this host.
        result["left"] = len(tagged(self.job_id).get(self.job_id, []))
        if not result["left"]:
            with suppress(OSError):
                release(self.job_id)
            self.claimed = False
        with suppress(OSError):
            say("exit", result)
        return code


def serve() -> int:
    state = Serving()
    signal.signal(signal.SIGHUP, state.hangup)
    if os.isatty(0):
        import termios
        import tty

        with suppress(termios.error):
            tty.setraw(0)
    say("ready", {"pid": os.getpid(), "hostname": socket.gethostname()})
    requests = Requests()
    while True:
        request = requests.next()
        if request is None or request["op"] == "abort":
            state.unclaim()
            return 0
        op = request["op"]
        try:
            if op == "preflight":
                say("preflight", preflight(request))
            elif op == "claim":
                say("claim", state.claim(request))
            elif op == "files":
                say("files", state.files(request))
            elif op == "start":
                return state.start(request)
            else:
                say("error", {"detail": f"unknown request {op!r}"})
        except Exception as exc:  # one bad request is reported, the channel stays usable
            say("error", {"detail": f"{op}: {type(exc).__name__}: {exc}"})


def main(argv: list[str], out: IO[str]) -> int:
    if argv[:1] == ["serve"]:
        return serve()
    if argv[:1] == ["reap"] and len(argv) == 3:
        result: dict[str, Any] = reap(argv[1], float(argv[2]))
        try:
            release(argv[1])
        except OSError as exc:
            result["lease_error"] = str(exc)
        out.write(MARK + "reap " + json.dumps(result) + "\n")
        return 0
    out.write("usage: agent serve | agent reap JOB_ID GRACE_S\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], sys.stdout))
