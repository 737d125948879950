"""The static tier: what each node says about itself, judged against the plan and inventory.

:class:`NodeFacts` is the per-node facts value the doctor judges. Whoever gathers facts (the
raw host-facts gatherer run through the job's backend) turns them into this shape; in JSON
(:meth:`NodeFacts.from_json`)::

    {
      "versions": {"python": "3.11.7", "torch": "2.13.0", "cuda": "12.8",
                   "nccl": "2.27.3", "driver": "570.86.15"},   # null where absent
      "interface": {"name": "eno1",          # the inventory's interface, else the route's
                    "exists": true, "up": true,
                    "speed_mbps": 25000,     # /sys/class/net/<if>/speed; null or -1: unknown
                    "routes_to_master": true,
                    "route_dev": "eno1",     # what `ip route get MASTER_ADDR` uses
                    "available": ["eno1", "eno2"]},
      "shm_bytes": 68719476736,              # os.statvfs("/dev/shm"): f_frsize * f_blocks
      "memlock": "unlimited",                # or bytes (/proc/self/limits "Max locked memory")
      "clock_offset_s": 0.004,               # this node's clock minus the reference's
      "gpus": [{"index": 0, "model": "A100-80GB", "memory_gb": 80, "bus_id": "0000:07:00.0"}],
                                             # or [index, model, memory_gb] triples; null: none
      "error": null                          # why facts could not be gathered (unreachable...)
    }

``model`` is the inventory's spelling (normalised, e.g. ``NVIDIA A100-SXM4-80GB`` ->
``A100-80GB``); GPUs are compared in PCI bus order, the CUDA order the plan's indices use.
Each GPU becomes the probe's :class:`orchestrate.probe.facts.GpuFact`, the one GPU record
(``index`` is its ``cuda_index``).

:func:`from_host` makes this shape from what the doctor's checkup gathers on a node (the raw
facts of :func:`orchestrate.hostside.hostfacts.gather`, parsed by
:func:`orchestrate.probe.facts.parse_facts`) and the clock offset its roll call measured against
node 0 (the reference the doctor uses,
:mod:`orchestrate.doctor.checkup.rollcall`).

Rules (reference notes §1.5): versions must be identical across nodes (python, torch, CUDA,
NCCL, driver: any difference fails, naming the odd nodes); planned GPUs present, of the
inventory's model and memory, in its order; the planned interface exists, is up, carries the
traffic to MASTER_ADDR and runs at the declared speed (below fails under 20 %, else warns);
/dev/shm at least 1 GiB when ranks share a node (a fail at <= 64 MiB with nccl, Docker's
default that breaks NCCL's shared memory); locked memory unlimited with nccl on InfiniBand or
RoCE; clock offset warns above 1 s and fails above 60 s.

Pure: values in, values out.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from orchestrate.doctor.grading import Check, JobShape, PlannedNode, Status
from orchestrate.doctor.hostsettings import HostSettings, judge_host_settings
from orchestrate.probe.facts import GpuFact, parse_facts

VERSIONS = ("python", "torch", "cuda", "nccl", "driver")
GPU_ONLY = frozenset({"cuda", "nccl", "driver"})
GiB = 1 << 30
MiB = 1 << 20
SHM_WARN_BELOW = GiB
SHM_FAIL_AT_OR_BELOW = 64 * MiB
CLOCK_WARN_S = 1.0
CLOCK_FAIL_S = 60.0
SPEED_WARN_BELOW = 0.95
SPEED_FAIL_BELOW = 0.2
MEMORY_TOLERANCE = 0.05
_VIRTUAL = re.compile(r"^(lo|docker\d*|veth.*|br-.*|virbr\d*|cni\d*|flannel.*|cali.*)$")


@dataclass(frozen=True)
class InterfaceFact:
    """The network interface that matters for the job on one node."""

    name: str
    exists: bool
    up: bool | None = None
    speed_mbps: int | None = None
    routes_to_master: bool | None = None
    route_dev: str | None = None
    available: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeFacts:
    """What one node says about itself (see the module docstring for the JSON)."""

    versions: Mapping[str, str | None]
    interface: InterfaceFact | None = None
    shm_bytes: int | None = None
    memlock: int | str | None = None  # bytes, "unlimited", or None (unknown)
    clock_offset_s: float | None = None
    gpus: tuple[GpuFact, ...] | None = None
    error: str | None = None
    host: HostSettings | None = None  # GPU hosts: IOMMU/ACS evidence (doctor.hostsettings)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeFacts:
        iface = data.get("interface")
        gpus = data.get("gpus")
        memlock = data.get("memlock")
        return cls(
            versions={k: (None if data.get("versions", {}).get(k) is None
                          else str(data["versions"][k])) for k in VERSIONS},
            interface=None if not iface else InterfaceFact(
                name=str(iface["name"]),
                exists=bool(iface.get("exists", True)),
                up=iface.get("up"),
                speed_mbps=None if iface.get("speed_mbps") is None else int(iface["speed_mbps"]),
                routes_to_master=iface.get("routes_to_master"),
                route_dev=iface.get("route_dev"),
                available=tuple(str(a) for a in iface.get("available", ())),
            ),
            shm_bytes=None if data.get("shm_bytes") is None else int(data["shm_bytes"]),
            memlock=memlock if memlock in (None, "unlimited") else int(memlock),
            clock_offset_s=None if data.get("clock_offset_s") is None
            else float(data["clock_offset_s"]),
            gpus=None if gpus is None else tuple(_gpu(g) for g in gpus),
            error=data.get("error"),
            host=None if not data.get("host_settings")
            else HostSettings.from_json(data["host_settings"]),
        )


def from_host(
    raw: Mapping[str, Any],
    *,
    interface: str | None,
    master_addr: str,
    clock_offset_s: float | None = None,
) -> NodeFacts:
    """The facts of one node from :func:`orchestrate.hostside.hostfacts.gather`'s dict, as the
    node's ranks saw it: ``interface`` is the GLOO_SOCKET_IFNAME the plan gave them (None: the
    route's
    interface is the one that matters), ``master_addr`` the MASTER_ADDR they were given."""
    parsed = parse_facts(raw)
    versions = {"python": parsed.python_version, "torch": parsed.torch,
                "cuda": parsed.torch_cuda, "nccl": parsed.nccl, "driver": parsed.driver}
    route = (raw.get("routes") or {}).get(master_addr) or {}
    route_dev = route.get("interface") if isinstance(route, Mapping) else None
    name = interface.lstrip("=") if interface else route_dev
    iface = None
    if name:
        nic = parsed.nic(name)
        # operstate "unknown": the driver does not say (loopback, many virtual links): not down.
        up = None if nic is None or nic.operstate in (None, "unknown") else nic.up
        iface = InterfaceFact(
            name=name,
            exists=nic is not None,
            up=up,
            speed_mbps=None if nic is None else nic.speed_mbps,
            routes_to_master=None if not route_dev else route_dev == name,
            route_dev=route_dev,
            available=tuple(n.name for n in parsed.nics if n.kind != "loopback"),
        )
    memlock = raw.get("memlock")
    soft = memlock.get("soft") if isinstance(memlock, Mapping) else None
    gpus = None if parsed.gpu_status == "missing" and not parsed.gpus else parsed.gpus
    return NodeFacts(
        versions=versions,
        interface=iface,
        shm_bytes=parsed.shm_bytes,
        memlock=soft if soft == "unlimited" or isinstance(soft, int) else None,
        clock_offset_s=clock_offset_s,
        gpus=gpus,
        host=None if not raw.get("host_settings") else HostSettings.from_json(raw["host_settings"]),
    )


def _gpu(item: Any) -> GpuFact:
    """A GPU of the JSON shape (the module docstring): what it says, nothing more (an unknown
    bus id is empty; the reported model stands for the product name too)."""
    if isinstance(item, Mapping):
        index, model, memory = item["index"], item["model"], item["memory_gb"]
        bus_id = item.get("bus_id") or ""
    else:
        (index, model, memory), bus_id = item[:3], ""
    return GpuFact(cuda_index=int(index), smi_index=None, bus_id=str(bus_id), name=str(model),
                   model=str(model), memory_gb=float(memory))


def judge_static(shape: JobShape, facts: Mapping[str, NodeFacts]) -> list[Check]:
    """Every static row for the planned nodes (a node without facts fails)."""
    rows: list[Check] = []
    known: dict[str, NodeFacts] = {}
    for node in shape.nodes:
        got = facts.get(node.name)
        if got is None or got.error:
            rows.append(Check(
                "static", "facts", (node.name,), "fail",
                f"no facts from {node.name}: {got.error if got else 'it did not answer'}",
                hint="check that the node is up and reachable through the job's backend",
            ))
        else:
            known[node.name] = got
    rows.extend(_versions(shape, known))
    for node in shape.nodes:
        got = known.get(node.name)
        if got is None:
            continue
        if node.gpu_indices:
            rows.append(_gpus(node, got))
            rows.extend(_host_settings(node, got))
        rows.extend(_interface(shape, node, got))
        rows.append(_shm(shape, node, got))
        row = _memlock(shape, node, got)
        if row is not None:
            rows.append(row)
        row = _clock(node, got, shape.nodes[0].name if shape.nodes else "the reference")
        if row is not None:
            rows.append(row)
    return rows


def _host_settings(node: PlannedNode, got: NodeFacts) -> list[Check]:
    """IOMMU, PCIe ACS and IOMMU faults of a GPU node (docs/containers.md), judged for the bus
    ids of its planned GPUs."""
    if got.host is None:
        return []
    planned = set(node.gpu_indices)
    buses = tuple(g.bus_id for g in got.gpus or () if g.cuda_index in planned and g.bus_id)
    return judge_host_settings(node.name, replace(got.host, gpu_bus_ids=buses))


def _versions(shape: JobShape, known: Mapping[str, NodeFacts]) -> list[Check]:
    rows: list[Check] = []
    gpu_nodes = {n.name for n in shape.nodes if n.gpu_indices}
    for key in VERSIONS:
        scope = [n for n in known if key not in GPU_ONLY or n in gpu_nodes]
        if not scope:
            continue
        values = {n: known[n].versions.get(key) for n in scope}
        if key in ("python", "torch"):
            missing = [n for n, v in values.items() if v is None]
            if missing:
                rows.append(Check(
                    "static", f"version: {key}", tuple(missing), "fail",
                    f"{key} not found on {', '.join(missing)}",
                    hint="point the inventory's python at an interpreter with torch",
                ))
                values = {n: v for n, v in values.items() if v is not None}
                if not values:
                    continue
        counts = Counter(values.values())
        if len(counts) == 1:
            value = next(iter(counts))
            rows.append(Check(
                "static", f"version: {key}", tuple(values), "pass",
                f"{key} {value if value is not None else 'absent'} on all {len(values)} "
                "node(s)", measured=str(value), expected="identical on every node",
            ))
            continue
        common, _ = counts.most_common(1)[0]
        tie = sum(1 for c in counts.values() if c == counts[common]) > 1
        odd = sorted(values) if tie else sorted(n for n, v in values.items() if v != common)
        groups = "; ".join(
            f"{', '.join(sorted(n for n, v in values.items() if v == value))}: {value}"
            for value in counts
        )
        rows.append(Check(
            "static", f"version: {key}", tuple(odd), "fail",
            f"{key} differs between nodes ({groups})",
            measured=", ".join(f"{n} {values[n]}" for n in odd),
            expected="identical on every node" + ("" if tie else f" ({common})"),
            hint=f"install the same {key} everywhere: mixed versions hang or fail in the "
                 "first collective, with no clear error (pytorch #174917)",
        ))
    return rows


def _same_model(a: str, b: str) -> bool:
    def norm(text: str) -> str:
        return re.sub(r"[\s_\-]", "", text).upper()

    return norm(a) == norm(b)


def _gpus(node: PlannedNode, got: NodeFacts) -> Check:
    name = node.name
    if got.versions.get("cuda") is None and got.versions.get("torch") is not None:
        return Check("static", "gpus", (name,), "fail",
                     f"torch on {name} is a CPU build (no CUDA), but GPUs are planned",
                     hint="install a CUDA build of torch for the node's python")
    if not got.gpus:
        return Check("static", "gpus", (name,), "fail",
                     f"{name} shows no GPUs (nvidia-smi found none or failed)",
                     expected=f"GPUs {list(node.gpu_indices)}",
                     hint="check the driver (nvidia-smi) on the node")
    in_order = sorted(got.gpus, key=lambda g: (not g.bus_id, g.bus_id, g.cuda_index))
    problems: list[str] = []
    planned = dict(zip(node.gpu_indices, node.gpu_models, strict=True))
    inventory = {g.index: g for g in node.node.gpus}
    for index, model in planned.items():
        if index >= len(in_order):
            problems.append(f"CUDA index {index} is not there ({len(in_order)} GPU(s) seen)")
            continue
        gpu = in_order[index]
        if not _same_model(gpu.model, model):
            elsewhere = [i for i, g in enumerate(in_order) if _same_model(g.model, model)]
            text = f"index {index} is {gpu.model}, the inventory says {model}"
            if elsewhere:
                text += (f" ({model} is at {', '.join(map(str, elsewhere))} in PCI bus order: "
                         "the inventory's indices are not in CUDA/PCI order)")
            problems.append(text)
            continue
        declared = inventory.get(index)
        if declared is not None and abs(gpu.memory_gb - declared.memory_gb) > max(
                1.0, MEMORY_TOLERANCE * declared.memory_gb):
            problems.append(f"index {index} has {gpu.memory_gb:g} GB, the inventory says "
                            f"{declared.memory_gb:g} GB")
    seen = ", ".join(f"{i}:{g.model}" for i, g in enumerate(in_order))
    if problems:
        return Check("static", "gpus", (name,), "fail", f"{name}: " + "; ".join(problems),
                     measured=seen, expected=", ".join(f"{i}:{m}" for i, m in planned.items()),
                     hint="fix the node's gpus in the inventory (CUDA indices in PCI bus "
                          "order), or the node")
    return Check("static", "gpus", (name,), "pass",
                 f"{len(planned)} planned GPU(s) present, models and memory as declared",
                 measured=seen, expected=", ".join(f"{i}:{m}" for i, m in planned.items()))


def _interface(shape: JobShape, node: PlannedNode, got: NodeFacts) -> list[Check]:
    name = node.name
    iface = got.interface
    multi = len(shape.nodes) > 1
    wanted = node.interface or (node.node.network.interface if node.node.network else None)
    if iface is None:
        if wanted or multi:
            return [Check("static", "interface", (name,), "warn",
                          f"{name} did not report its interface", expected=wanted)]
        return []
    if wanted and not iface.exists:
        have = f" (it has: {', '.join(iface.available)})" if iface.available else ""
        return [Check("static", "interface", (name,), "fail",
                      f"{wanted} does not exist on {name}{have}", measured="missing",
                      expected=wanted,
                      hint="set the node's network.interface in the inventory to one it has")]
    label = iface.name
    if iface.up is False:
        return [Check("static", "interface", (name,), "fail", f"{label} is down on {name}",
                      measured="down", expected="up",
                      hint=f"bring it up (ip link set {label} up) or use another")]
    is_master = node is shape.nodes[0] or node.node.address == shape.master_addr
    if multi and iface.routes_to_master is False and not (is_master and iface.route_dev == "lo"):
        return [Check(
            "static", "interface", (name,), "fail",
            f"traffic from {name} to MASTER_ADDR {shape.master_addr} leaves through "
            f"{iface.route_dev or 'another interface'}, not {label}",
            measured=iface.route_dev, expected=label,
            hint="set network.interface to the interface that routes to the master, or fix "
                 "the routes",
        )]
    if multi and not wanted and iface.route_dev and _VIRTUAL.match(iface.route_dev):
        return [Check(
            "static", "interface", (name,), "warn",
            f"traffic from {name} to the master leaves through {iface.route_dev}, a virtual "
            "device", measured=iface.route_dev, expected="a physical NIC",
            hint="set network.interface in the inventory (docker0/veth carry no job traffic)",
        )]
    return [_speed(node, iface, multi)]


def _speed(node: PlannedNode, iface: InterfaceFact, multi: bool) -> Check:
    """An interface that is up (and routes to the master): at the inventory's speed?"""
    name, label = node.name, iface.name
    gbps = node.node.network.gbps if node.node.network else None
    speed = iface.speed_mbps
    if gbps is None or speed is None or speed <= 0:
        return Check(
            "static", "interface", (name,), "pass",
            f"{label} is up" + (" and routes to the master" if multi else "")
            + ("" if speed and speed > 0 else "; link speed unknown (virtual link?)"),
            measured=f"{speed} Mb/s" if speed and speed > 0 else None,
            expected=f"{gbps:g} Gb/s" if gbps else None,
        )
    share = speed / 1000.0 / gbps
    status: Status = "fail" if share < SPEED_FAIL_BELOW else (
        "warn" if share < SPEED_WARN_BELOW else "pass")
    return Check(
        "static", "interface", (name,), status,
        f"{label} is up and runs at {speed / 1000:g} Gb/s"
        + ("" if status == "pass" else f", {share:.0%} of the inventory's {gbps:g} Gb/s"),
        measured=f"{speed / 1000:g} Gb/s", expected=f"{gbps:g} Gb/s",
        hint="" if status == "pass" else
        f"check the link (ethtool {label}: negotiated speed, cable) or the declared gbps",
    )


def _shm(shape: JobShape, node: PlannedNode, got: NodeFacts) -> Check:
    name = node.name
    size = got.shm_bytes
    if size is None:
        return Check("static", "/dev/shm", (name,), "warn" if node.nproc > 1 else "pass",
                     f"/dev/shm size unknown on {name}")
    shown = f"{size / GiB:.3g} GiB" if size >= GiB else f"{size / MiB:.3g} MiB"
    status: Status
    if node.nproc > 1 and shape.backend == "nccl" and size <= SHM_FAIL_AT_OR_BELOW:
        status = "fail"
    elif node.nproc > 1 and size < SHM_WARN_BELOW:
        status = "warn"
    else:
        status = "pass"
    return Check(
        "static", "/dev/shm", (name,), status,
        f"/dev/shm is {shown} for {node.nproc} rank(s)",
        measured=shown, expected=">= 1 GiB when ranks share a node",
        hint="" if status == "pass" else
        "enlarge it (docker run --shm-size=1g or --ipc=host; mount -o remount,size=...): NCCL "
        "fails with 'No space left on device' in ncclShmOpen (NCCL #342)",
    )


def _memlock(shape: JobShape, node: PlannedNode, got: NodeFacts) -> Check | None:
    net = node.node.network
    if shape.backend != "nccl" or net is None or net.fabric not in ("infiniband", "roce"):
        return None
    name = node.name
    value = got.memlock
    if value == "unlimited":
        return Check("static", "memlock", (name,), "pass", "locked memory is unlimited",
                     measured="unlimited", expected="unlimited")
    if value is None:
        return Check("static", "memlock", (name,), "warn",
                     f"locked-memory limit unknown on {name}", expected="unlimited")
    return Check(
        "static", "memlock", (name,), "fail",
        f"locked memory is limited to {int(value) // 1024} KiB on {name}; RDMA ({net.fabric}) "
        "registers buffers and fails with 'Cannot allocate memory' (nccl-tests #206)",
        measured=f"{int(value) // 1024} KiB", expected="unlimited",
        hint="ulimit -l unlimited in the launch context (limits.conf, Slurm "
             "PropagateResourceLimits, docker --ulimit memlock=-1)",
    )


def _clock(node: PlannedNode, got: NodeFacts, reference: str) -> Check | None:
    offset = got.clock_offset_s
    if offset is None:
        return None
    size = abs(offset)
    status: Status = "fail" if size > CLOCK_FAIL_S else (
        "warn" if size > CLOCK_WARN_S else "pass")
    return Check(
        "static", "clock", (node.name,), status,
        f"{node.name}'s clock is {offset:+.3f} s from {reference}'s",
        measured=f"{offset:+.3f} s", expected=f"within {CLOCK_WARN_S:g} s",
        hint="" if status == "pass" else
        "run NTP/chrony on the node: merged logs and stall times across nodes need one clock "
        "(and Slurm's MUNGE credentials expire)",
    )


def facts_from_json(data: Mapping[str, Mapping[str, Any]]) -> dict[str, NodeFacts]:
    """``{node name: facts JSON}`` -> typed facts."""
    return {name: NodeFacts.from_json(item) for name, item in data.items()}


__all__: Sequence[str] = ["InterfaceFact", "NodeFacts", "facts_from_json",
                          "from_host", "judge_static"]
