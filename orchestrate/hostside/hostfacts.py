"""Raw facts about the machine it runs on: GPUs, links, NICs, CPUs, memory, python and torch.

Standard library only, Python 3.8+, importing nothing of orchestrate but
:mod:`orchestrate.hostside.smi` (how nvidia-smi is run and read, shared with the GPU-use check):
the SSH and Slurm transports ship the two as the ``gatherer`` program
(:mod:`orchestrate.probe.gathering`) and run it with ``python -S``; it prints the facts as one
JSON line. It only *collects*: the controller parses (``orchestrate.probe.facts``), because
parsing in one place is what lets golden tests replay the real outputs of machines we do not
have.

Every step is bounded (each subprocess has a timeout) and a failing step becomes data, never an
exception: a host without ``nvidia-smi`` is a CPU node, one whose ``nvidia-smi`` fails (driver
mismatch) is reported with its message, and the other facts still come back.

:func:`gather` returns a JSON-able dict (``FACTS_VERSION`` 1)::

    version        1
    hostname       socket.gethostname()
    slurm_node     the Slurm node name when run as a Slurm task (SLURMD_NODENAME), else None
    time           time.time() when gathering started (the controller derives clock offset)
    gather_s       seconds gathering took
    nvidia_smi     {"status": "ok" | "missing" | "failed",
                    "fields": [the --query-gpu fields asked], "query": CSV text with header
                    (--format=csv,nounits) or None, "topo": `nvidia-smi topo -m` text or None,
                    "error": message when failed (stdout+stderr, exit status), "topo_error"}
    net            {"interfaces": [{"name", "operstate", "speed_mbps" (None: unknown), "mtu",
                    "type" (ARPHRD: 1 ether, 32 infiniband, 772 loopback), "physical" (has a
                    `device` link), "bridge", "addresses": [IPv4/IPv6 strings]}],
                    "infiniband": [{"name", "netdevs": [...], "ports": [{"port", "state",
                    "rate", "link_layer"}]}]}
    routes         {peer: {"interface", "ip"} | {"error"}} for every peer asked about
    cpus           {"count": os.cpu_count(), "usable": CPUs this process may run on}
    numa           {node number: its CPU list} from /sys/devices/system/node ({}: none there)
    memory_kib     MemTotal from /proc/meminfo, or None
    python         {"executable", "version"}
    torch          None (not asked) | {"version", "cuda", "nccl", "imported"} | {"error"}
    shm_bytes      size of /dev/shm, or None
    memlock        {"soft", "hard"}: bytes or "unlimited", from /proc/self/limits, or None
    containers     the container runtimes found: podman, docker, apptainer, pyxis
    host_settings  GPU hosts: cmdline, iommu_units, lspci, kernel_log (or None)
    errors         [one sentence per step that failed]

``ORCHESTRATE_SYSFS_ROOT`` (default ``/sys``) moves the sysfs tree, so tests can hand in a fake
one; ``ORCHESTRATE_PROC_ROOT`` (default ``/proc``) does the same for /proc.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess  # gathering facts from commands is this module's whole job
import sys
import time

from orchestrate.hostside.smi import finish, message, query, run, start, stop

TYPE_CHECKING = False  # typing costs start-up time on every host; only the checker needs it
if TYPE_CHECKING:
    from typing import Any

FACTS_VERSION = 1

#: What each GPU is asked. Beyond the identity, memory, driver and PCIe link fields the probe
#: needs: ``uuid`` tells a replaced board from the one probed before, ``compute_cap`` lets the
#: doctor check torch's arch list, ``utilization.gpu`` separates a PCIe link that downshifted
#: because the GPU idles (normal power saving) from one that runs slow under load, and
#: ``mig.mode.current`` explains a GPU CUDA cannot see whole.
GPU_FIELDS = (
    "index", "pci.bus_id", "uuid", "name", "memory.total", "driver_version", "compute_cap",
    "pcie.link.gen.max", "pcie.link.gen.current", "pcie.link.width.max",
    "pcie.link.width.current", "utilization.gpu", "mig.mode.current",
)
#: Drivers older than ~510 refuse the whole query over one field they do not know
#: (``Field "compute_cap" is not a valid field to query.``): then ask these, known for years.
GPU_FIELDS_OLD = tuple(f for f in GPU_FIELDS if f not in ("compute_cap", "mig.mode.current"))

NVIDIA_SMI_TIMEOUT_S = 20.0
IP_TIMEOUT_S = 5.0
TORCH_TIMEOUT_S = 120.0
SIOCGIFADDR = 0x8915

#: Reads torch's version without importing it (importing costs seconds to a minute on a busy
#: host, per host): ``torch/version.py`` holds ``__version__`` and ``cuda``; the NCCL of the pip
#: wheels is the ``nvidia-nccl-cu*`` package's version.
_TORCH_FILES = r"""
import importlib.util, json, os, re
spec = importlib.util.find_spec("torch")
if spec is None or not spec.submodule_search_locations:
    raise SystemExit("ModuleNotFoundError: No module named 'torch'")
with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as f:
    text = f.read()
def field(name):
    m = re.search(r"^" + name + r"\s*(?::[^=\n]*)?=\s*['\"]([^'\"]*)['\"]", text, re.M)
    return m.group(1) if m else None
nccl = None
try:
    import importlib.metadata as md
    for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"):
        try:
            nccl = md.version(dist)
            break
        except md.PackageNotFoundError:
            pass
except ImportError:
    pass
print(json.dumps({"version": field("__version__"), "cuda": field("cuda"), "nccl": nccl,
                  "imported": False}))
"""
#: Imports torch: slower, but proves it loads (and asks torch for its own NCCL).
_TORCH_IMPORT = (
    "import json, torch\n"
    "nccl = None\n"
    "try:\n"
    "    v = torch.cuda.nccl.version()\n"
    "    nccl = '.'.join(map(str, v)) if isinstance(v, tuple) else str(v)\n"
    "except Exception:\n"
    "    pass\n"
    "print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda, "
    "'nccl': nccl, 'imported': True}))\n"
)


def sysfs_root() -> str:
    return os.environ.get("ORCHESTRATE_SYSFS_ROOT") or "/sys"


def proc_root() -> str:
    return os.environ.get("ORCHESTRATE_PROC_ROOT") or "/proc"


def read(path: str) -> str | None:
    """A small file's stripped text, or None when it cannot be read (sysfs raises EINVAL
    for the speed of a link that is down)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return None


def nvidia_smi(topo: bool = True) -> dict[str, Any]:
    """The --query-gpu CSV and (unless not ``topo``) the topology matrix, or why there are
    none. ``topo -m`` runs alongside the query (each nvidia-smi start costs the driver's
    initialisation), so the two cost one bound, not two."""
    report: dict[str, Any] = {"status": "ok", "fields": None, "query": None, "topo": None,
                              "error": None, "topo_error": None}
    matrix = start(["nvidia-smi", "topo", "-m"]) if topo else None
    deadline = time.monotonic() + NVIDIA_SMI_TIMEOUT_S
    for fields in (GPU_FIELDS, GPU_FIELDS_OLD):
        answer = query("gpu", fields, NVIDIA_SMI_TIMEOUT_S)
        report["status"], report["query"], report["error"] = \
            answer["status"], answer["text"], answer["error"]
        if answer["status"] == "ok":
            report["fields"] = list(fields)
            break
        if answer["status"] == "missing" or "not a valid field" not in answer["error"]:
            break
    if report["query"] is None:
        if matrix is not None:
            stop(matrix)
        return report
    if matrix is not None:
        code, out, err = finish(matrix, deadline - time.monotonic(), "nvidia-smi")
        if code == 0:
            report["topo"] = out
        else:
            report["topo_error"] = message(code, out, err)
    return report


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def interfaces() -> list[dict[str, Any]]:
    """Every network interface in sysfs, with what tells a NIC from a virtual device."""
    base = os.path.join(sysfs_root(), "class", "net")
    addresses = _addresses()
    out: list[dict[str, Any]] = []
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return out
    for name in names:
        path = os.path.join(base, name)
        speed = _int(read(os.path.join(path, "speed")))
        out.append({
            "name": name,
            "operstate": read(os.path.join(path, "operstate")),
            "speed_mbps": speed if speed is not None and speed > 0 else None,
            "mtu": _int(read(os.path.join(path, "mtu"))),
            "type": _int(read(os.path.join(path, "type"))),
            "physical": os.path.exists(os.path.join(path, "device")),
            "bridge": os.path.isdir(os.path.join(path, "bridge")),
            "addresses": addresses.get(name, []),
        })
    return out


def _addresses() -> dict[str, list[str]]:
    """Interface -> its IP addresses, from ``ip -o addr`` (empty without iproute2)."""
    code, out, _ = run(["ip", "-o", "addr", "show"], IP_TIMEOUT_S)
    found: dict[str, list[str]] = {}
    if code != 0:
        return found
    for line in out.splitlines():
        words = line.split()
        if len(words) >= 4 and words[2] in ("inet", "inet6"):
            found.setdefault(words[1].split("@")[0], []).append(words[3].split("/")[0])
    return found


def infiniband() -> list[dict[str, Any]]:
    """InfiniBand/RoCE HCAs: their ports (state, rate, link layer) and the netdevs they back."""
    base = os.path.join(sysfs_root(), "class", "infiniband")
    out: list[dict[str, Any]] = []
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return out
    for name in names:
        path = os.path.join(base, name)
        try:
            netdevs = sorted(os.listdir(os.path.join(path, "device", "net")))
        except OSError:
            netdevs = []
        ports = []
        try:
            port_names = sorted(os.listdir(os.path.join(path, "ports")), key=_port_key)
        except OSError:
            port_names = []
        for port in port_names:
            ppath = os.path.join(path, "ports", port)
            ports.append({
                "port": _int(port),
                "state": read(os.path.join(ppath, "state")),
                "rate": read(os.path.join(ppath, "rate")),
                "link_layer": read(os.path.join(ppath, "link_layer")),
            })
        out.append({"name": name, "netdevs": netdevs, "ports": ports})
    return out


def _port_key(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)


def route(peer: str) -> dict[str, Any]:
    """The interface traffic to ``peer`` leaves by: ``ip -o route get`` names it (on the host
    owning the address, the interface holding it); without iproute2, the source address the
    kernel picks for a UDP socket towards the peer (no packet is sent) and who owns it."""
    try:
        info = socket.getaddrinfo(peer, None, 0, socket.SOCK_DGRAM)
    except OSError as exc:
        return {"error": f"cannot resolve {peer}: {exc}"}
    family, ip = info[0][0], str(info[0][4][0])
    code, out, _ = run(["ip", "-o", "route", "get", ip], IP_TIMEOUT_S)
    words = out.split()
    if code == 0 and "dev" in words:
        name = words[words.index("dev") + 1].split("@")[0]
        if words[0] == "local":
            owner = _owner_of(ip)
            name = owner or name
        return {"interface": name, "ip": ip}
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((ip, 9))
            source = probe.getsockname()[0]
    except OSError as exc:
        return {"error": f"no route to {ip}: {exc}"}
    owner = _owner_of(source)
    if owner:
        return {"interface": owner, "ip": ip}
    return {"error": f"no interface found holding {source}, the source address towards {ip}"}


def _owner_of(address: str) -> str | None:
    """The interface holding ``address``: from ``ip -o addr``, else SIOCGIFADDR per interface."""
    for name, addrs in _addresses().items():
        if address in addrs:
            return name
    try:
        import fcntl  # POSIX only; imported here so that the rest still runs anywhere

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _, name in socket.if_nameindex():
                request = struct.pack("256s", name.encode()[:15])
                try:
                    answer = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
                except OSError:
                    continue
                if socket.inet_ntoa(answer[20:24]) == address:
                    return name
    except (OSError, ImportError):
        pass
    return None


def meminfo_kib() -> int | None:
    text = read(os.path.join(proc_root(), "meminfo")) or ""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return _int(line.split()[1])
    return None


def memlock() -> dict[str, Any] | None:
    """The locked-memory limit (RDMA registers memory; a small one breaks NCCL over IB)."""
    text = read(os.path.join(proc_root(), "self", "limits")) or ""
    for line in text.splitlines():
        if line.startswith("Max locked memory"):
            words = line[len("Max locked memory"):].split()
            if len(words) >= 2:
                return {"soft": _limit(words[0]), "hard": _limit(words[1])}
    return None


def _limit(word: str) -> Any:
    return word if word == "unlimited" else _int(word)


def shm_bytes() -> int | None:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stat.f_blocks * stat.f_frsize


def container_runtimes() -> list[str]:
    """The container runtimes here (docs/containers.md): podman, docker and apptainer on the
    PATH; pyxis where enroot is and Slurm's plugstack names pyxis."""
    path = os.environ.get("ORCHESTRATE_RUNTIMES_PATH")  # tests: a captured machine's PATH
    found = [name for name in ("podman", "docker", "apptainer") if shutil.which(name, path=path)]
    folder = "/etc/slurm/plugstack.conf.d"
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    stack = [read("/etc/slurm/plugstack.conf")] + [read(os.path.join(folder, n)) for n in names]
    if shutil.which("enroot", path=path) and any("pyxis" in (text or "") for text in stack):
        found.append("pyxis")
    return found


def host_settings() -> dict[str, Any]:
    """A GPU host's IOMMU and PCIe ACS settings and IOMMU faults, for the doctor's host checks
    (orchestrate.doctor.hostsettings): /proc/cmdline, /sys/class/iommu, `lspci -vvv`, the
    kernel log's fault lines. None where unreadable (lspci and dmesg may need root)."""
    folder = os.path.join(sysfs_root(), "class", "iommu")
    lspci = run(["lspci", "-vvv"], NVIDIA_SMI_TIMEOUT_S)
    dmesg = run(["dmesg"], IP_TIMEOUT_S)
    faults = [ln for ln in dmesg[1].splitlines() if "IO_PAGE_FAULT" in ln or "DMAR" in ln]
    return {"cmdline": read(os.path.join(proc_root(), "cmdline")),
            "iommu_units": sorted(os.listdir(folder)) if os.path.isdir(folder) else None,
            "lspci": lspci[1] if lspci[0] == 0 else None,
            "kernel_log": "\n".join(faults) if dmesg[0] == 0 else None}


def usable_cpus() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def numa_nodes() -> dict[str, str]:
    """Each NUMA node's CPU list (``/sys/devices/system/node/nodeN/cpulist``), by node number;
    {} where sysfs has no such folder."""
    root = os.path.join(sysfs_root(), "devices", "system", "node")
    found: dict[str, str] = {}
    try:
        names = os.listdir(root)
    except OSError:
        return found
    for name in names:
        if name.startswith("node") and name[4:].isdigit():
            try:
                with open(os.path.join(root, name, "cpulist")) as handle:
                    cpus = handle.read().strip()
            except OSError:
                continue
            if cpus:
                found[name[4:]] = cpus
    return found


def start_torch(python: str, load: bool) -> subprocess.Popen[bytes] | None:
    try:
        return subprocess.Popen(
            [python, "-c", _TORCH_IMPORT if load else _TORCH_FILES], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
    except OSError:
        return None


def finish_torch(proc: subprocess.Popen[bytes] | None, deadline: float) -> dict[str, Any]:
    if proc is None:
        return {"error": "could not start the python interpreter to look for torch"}
    try:
        out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": f"looking for torch took over {TORCH_TIMEOUT_S:.0f}s"}
    lines = out.decode("utf-8", "replace").strip().splitlines()
    if proc.returncode == 0 and lines:
        try:
            return dict(json.loads(lines[-1]))
        except ValueError:
            pass
    return {"error": lines[-1] if lines else f"exit status {proc.returncode}"}


def gather(peers: tuple[str, ...] | list[str] = (), torch: bool = True,
           python: str | None = None, import_torch: bool = False) -> dict[str, Any]:
    """Every fact about this host (see the module docstring for the dict); never raises for
    what the host lacks. ``peers``: addresses of the other nodes, to learn which interface
    reaches them; ``torch``: also find torch's version, in a bounded child of ``python``
    (default: this interpreter) running in parallel with the rest, by reading its files or,
    with ``import_torch``, by importing it."""
    started, clock = time.time(), time.monotonic()
    python = python or sys.executable
    proc = start_torch(python, import_torch) if torch else None
    facts: dict[str, Any] = {
        "version": FACTS_VERSION,
        "hostname": socket.gethostname(),
        "slurm_node": os.environ.get("SLURMD_NODENAME"),
        "time": started,
        "errors": [],
    }
    facts["nvidia_smi"] = nvidia_smi()
    facts["net"] = {"interfaces": interfaces(), "infiniband": infiniband()}
    facts["routes"] = {peer: route(peer) for peer in peers}
    facts["cpus"] = {"count": os.cpu_count(), "usable": usable_cpus()}
    facts["numa"] = numa_nodes()
    facts["memory_kib"] = meminfo_kib()
    facts["python"] = {"executable": python, "version": sys.version.split()[0]}
    facts["shm_bytes"] = shm_bytes()
    facts["memlock"] = memlock()
    facts["containers"] = container_runtimes()
    facts["torch"] = finish_torch(proc, clock + TORCH_TIMEOUT_S) if torch else None
    facts["host_settings"] = host_settings() if facts["nvidia_smi"]["status"] == "ok" else None
    if facts["nvidia_smi"]["status"] == "failed":
        facts["errors"].append("nvidia-smi failed: " + str(facts["nvidia_smi"]["error"]))
    for peer, found in facts["routes"].items():
        if "error" in found:
            facts["errors"].append(f"route to {peer}: {found['error']}")
    if facts["torch"] is not None and "error" in facts["torch"]:
        facts["errors"].append("torch: " + str(facts["torch"]["error"]))
    facts["gather_s"] = round(time.monotonic() - clock, 3)
    return facts


def main(argv: list[str]) -> int:
    """``python -S hostfacts.py [--no-torch | --import-torch] [PEER...]``: the facts as one
    JSON line."""
    args = [a for a in argv if a not in ("--no-torch", "--import-torch")]
    facts = gather(args, torch="--no-torch" not in argv, import_torch="--import-torch" in argv)
    sys.stdout.write(json.dumps(facts) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
