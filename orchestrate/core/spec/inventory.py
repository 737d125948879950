"""The inventory: which nodes exist, their GPUs in CUDA (PCI bus) order, and how they connect.

The file is validated into :class:`InventorySpec`; :func:`resolve_inventory` then expands
hostlists, applies ``defaults`` and returns the :class:`Inventory` value the planner works on.
Both are pure: reading the file is :func:`load_inventory`'s only side effect.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from orchestrate.core.errors import Problem, UserError
from orchestrate.core.spec import hostlist
from orchestrate.core.spec.container import ContainerRuntime
from orchestrate.core.spec.cpulist import CPULIST, cpu_set
from orchestrate.core.spec.loader import Lines, read_yaml, validate
from orchestrate.core.spec.schema import Bool, Float, Int, MaybeFloat, MaybeInt, Spec, single_line

GpuLink = Literal["nvlink", "nvswitch", "pcie", "none"]
Fabric = Literal["infiniband", "roce", "ethernet"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-\[\],]*$")
#: A host name, an IPv4 address or an IPv6 address (with an optional %zone).
_ADDRESS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:%\-]*$")
_IFNAME = re.compile(r"^[A-Za-z0-9_.:^,\-=]+$")
#: The most GPUs (and the highest CUDA index + 1) of one node, and the most CPU slots: far more
#: than any machine has, and few enough that the planner's per-rank records stay small (a count
#: of 346,361,855 was a MemoryError).
MAX_GPUS = 1024
MAX_SLOTS = 4096


class SSHSpec(Spec):
    """How to reach a node over SSH; unset fields fall back to ``~/.ssh/config``."""

    user: str | None = None
    port: MaybeInt = Field(default=None, ge=1, le=65535)
    identity_file: str | None = None
    config_file: str | None = Field(default=None, description="an ssh_config to read")
    known_hosts_file: str | None = None
    accept_unknown_host_keys: Bool = Field(
        default=False, description="trust a host key seen for the first time (off: verify)"
    )
    connect_timeout_s: MaybeFloat = Field(default=None, gt=0)


class GpuGroup(Spec):
    """GPUs of one model on one node; ``indices`` are CUDA indices in PCI bus order."""

    model: str = Field(min_length=1)
    memory_gb: Float = Field(gt=0)
    indices: list[Int] | None = None
    count: MaybeInt = Field(default=None, ge=1, le=MAX_GPUS,
                            description="shorthand for indices 0..count-1")
    tflops: MaybeFloat = Field(
        default=None, gt=0, description="dense BF16 TFLOPS, for train.batch_split: proportional "
        "(default: the datasheet figure of known models)")

    @model_validator(mode="after")
    def _indices_or_count(self) -> GpuGroup:
        if (self.indices is None) == (self.count is None):
            raise ValueError("give exactly one of 'indices' (CUDA indices) or 'count'")
        if self.indices is not None:
            if not self.indices:
                raise ValueError("'indices' is empty")
            if any(i < 0 for i in self.indices):
                raise ValueError("CUDA indices start at 0")
            if any(i >= MAX_GPUS for i in self.indices):
                raise ValueError(f"CUDA indices of one node are below {MAX_GPUS}")
            if len(set(self.indices)) != len(self.indices):
                raise ValueError("an index appears twice")
        return self


class NumaSpec(Spec):
    """One NUMA node of a machine: its CPUs and the GPUs (CUDA indices) attached to it."""

    node: Int = Field(ge=0)
    cpus: str = Field(min_length=1, description="a CPU list, e.g. '0-55,112-167'")
    gpus: list[Int] = Field(default_factory=list)

    @field_validator("cpus")
    @classmethod
    def _cpulist(cls, value: str) -> str:
        value = value.strip()
        if not CPULIST.match(value):
            raise ValueError("a CPU list such as '0-55,112-167'")
        if len(cpu_set(value)) > MAX_SLOTS * 16:
            raise ValueError("more CPUs than a machine has")
        return value


class IslandSpec(Spec):
    """GPUs that reach each other without crossing the CPU: under one PCIe switch (``PIX`` or
    ``PXB`` in ``nvidia-smi topo -m``) or joined by NVLink (``NV#``)."""

    gpus: list[Int] = Field(min_length=2)
    via: Literal["nvlink", "pcie-switch"] = "pcie-switch"


class NetworkSpec(Spec):
    """The inter-node network a node talks DDP over."""

    interface: str | None = None
    fabric: Fabric = "ethernet"
    gbps: MaybeFloat = Field(default=None, gt=0)
    hca: str | None = None

    @field_validator("interface")
    @classmethod
    def _ifname(cls, value: str | None) -> str | None:
        if value is not None and not _IFNAME.match(value):
            raise ValueError("not a network interface name")
        return value


class SlurmNodeSpec(Spec):
    """The node is reached through Slurm."""

    partition: str | None = None
    gres_type: str | None = Field(
        default=None, description="the GRES type of its GPUs, e.g. 'a100' for gpu:a100:N"
    )

    @field_validator("partition", "gres_type")
    @classmethod
    def _one_line(cls, value: str | None) -> str | None:
        return None if value is None else single_line(value)


#: The inventory's word on where a host's lease book is (docs/shared-servers.md).
LEASE_DIR_HELP = ("the machine's shared lease book, an absolute path (default: "
                  "$ORCHESTRATE_LEASES there, else /var/tmp/orchestrate/leases)")


def _absolute(value: str | None) -> str | None:
    if value is not None and not value.startswith("/"):
        raise ValueError("an absolute path, the same for every user of the host")
    return value


class NodeDefaults(Spec):
    """Settings every node inherits unless it says otherwise."""

    ssh: SSHSpec | None = None
    python: str | None = None
    gpu_link: GpuLink | None = None
    network: NetworkSpec | None = None
    slurm: SlurmNodeSpec | None = None
    cpus: MaybeInt = Field(default=None, ge=1)
    containers: list[ContainerRuntime] | None = None
    host_memory_gb: MaybeFloat = Field(default=None, gt=0)
    lease_dir: str | None = Field(default=None, description=LEASE_DIR_HELP)

    @field_validator("lease_dir")
    @classmethod
    def _lease_dir(cls, value: str | None) -> str | None:
        return _absolute(value)


#: What a node's ``containers`` says (``inventory probe`` records what it finds; [] is "none").
CONTAINERS_FIELD = Field(
    default=None, description="container runtimes the node has (inventory probe records "
    "them); unset: unknown")


class NodeSpec(Spec):
    """One node, or many identical ones when ``name`` is a hostlist like ``gpu[01-16]``."""

    name: str = Field(min_length=1)
    address: str | None = None
    gpus: list[GpuGroup] = Field(default_factory=list)
    slots: MaybeInt = Field(default=None, ge=1, le=MAX_SLOTS,
                            description="CPU-only: processes to run")
    gpu_link: GpuLink | None = None
    network: NetworkSpec | None = None
    slurm: SlurmNodeSpec | None = None
    ssh: SSHSpec | None = None
    python: str | None = None
    cpus: MaybeInt = Field(default=None, ge=1)
    containers: list[ContainerRuntime] | None = CONTAINERS_FIELD
    host_memory_gb: MaybeFloat = Field(
        default=None, gt=0, description="the node's RAM: the planner checks that the ranks can "
        "load the model (and CPU ranks train it) in it")
    lease_dir: str | None = Field(default=None, description=LEASE_DIR_HELP)
    numa: list[NumaSpec] | None = Field(
        default=None, description="NUMA nodes with their CPUs and GPUs (inventory probe "
        "records them): the planner keeps a job's GPUs on one and binds ranks' CPUs to it")
    gpu_islands: list[IslandSpec] | None = Field(
        default=None, description="GPUs under one PCIe switch or joined by NVLink")

    @field_validator("lease_dir")
    @classmethod
    def _lease_dir(cls, value: str | None) -> str | None:
        return _absolute(value)

    @field_validator("address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None and not _ADDRESS.match(value):
            raise ValueError("not a host name or address")
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError("a node name is a hostname or a hostlist like 'gpu[01-16]'")
        try:
            hostlist.expand(value)
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _gpus_or_slots(self) -> NodeSpec:
        if self.gpus and self.slots is not None:
            raise ValueError("a node has 'gpus' or 'slots' (CPU-only), not both")
        if not self.gpus and self.slots is None:
            raise ValueError("a node needs 'gpus' or, for a CPU-only node, 'slots'")
        return self


class InventorySpec(Spec):
    """The inventory file."""

    name: str = Field(min_length=1)
    defaults: NodeDefaults = Field(default_factory=NodeDefaults)
    nodes: list[NodeSpec] = Field(min_length=1)


@dataclass(frozen=True)
class Gpu:
    """One GPU: its CUDA index (PCI bus order), model and memory."""

    index: int
    model: str
    memory_gb: float
    tflops: float | None = None  # the inventory's speed figure, when it gives one


@dataclass(frozen=True)
class Numa:
    """A NUMA node of a machine: its number, its CPUs (a CPU list) and its GPUs."""

    node: int
    cpus: str
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class Island:
    """GPUs that talk without crossing the CPU: one PCIe switch, or NVLink."""

    gpus: tuple[int, ...]
    via: str = "pcie-switch"


@dataclass(frozen=True)
class Node:
    """A node with defaults applied and its hostlist expanded."""

    name: str
    address: str
    gpus: tuple[Gpu, ...] = ()
    slots: int | None = None
    gpu_link: GpuLink = "pcie"
    network: NetworkSpec | None = None
    partition: str | None = None
    gres_type: str | None = None
    ssh: SSHSpec = field(default_factory=SSHSpec)
    python: str | None = None
    cpus: int | None = None
    containers: tuple[str, ...] | None = None  # container runtimes there; None: unknown
    host_memory_gb: float | None = None
    lease_dir: str | None = None  # the host's shared lease book (None: its default)
    numa: tuple[Numa, ...] = ()  # NUMA nodes (empty: unknown)
    islands: tuple[Island, ...] = ()  # GPUs under one PCIe switch or NVLink

    def numa_of(self, gpu: int) -> Numa | None:
        """The NUMA node GPU ``gpu`` (CUDA index) is attached to, if known."""
        return next((n for n in self.numa if gpu in n.gpus), None)

    @property
    def is_gpu(self) -> bool:
        """Whether ranks on this node drive GPUs (else they are CPU processes)."""
        return bool(self.gpus)

    @property
    def capacity(self) -> int:
        """How many ranks fit: one per GPU, or the CPU slots."""
        return len(self.gpus) if self.gpus else (self.slots or 0)

    def models(self) -> dict[str, int]:
        """GPU count per model, in order of first appearance."""
        counts: dict[str, int] = {}
        for gpu in self.gpus:
            counts[gpu.model] = counts.get(gpu.model, 0) + 1
        return counts


@dataclass(frozen=True)
class Inventory:
    """The resolved inventory."""

    name: str
    nodes: tuple[Node, ...]
    source: str = ""

    def node(self, name: str) -> Node | None:
        """The node called ``name``, if any (a dict lookup: inventories run to thousands)."""
        return self._by_name.get(name)

    @cached_property
    def _by_name(self) -> dict[str, Node]:
        return {node.name: node for node in self.nodes}

    def model_counts(self) -> dict[str, int]:
        """GPUs per model over the whole inventory (for error messages)."""
        counts: dict[str, int] = {}
        for node in self.nodes:
            for model, n in node.models().items():
                counts[model] = counts.get(model, 0) + n
        return counts


def load_inventory_spec(path: Path) -> tuple[InventorySpec, Lines]:
    """Read and validate an inventory file (the spec, and each field's line for errors)."""
    data, lines = read_yaml(path)
    return validate(InventorySpec, data, str(path), lines), lines


def load_inventory(path: Path) -> Inventory:
    """Read, validate and resolve an inventory file."""
    spec, lines = load_inventory_spec(path)
    return resolve_inventory(spec, str(path), lines)


def resolve_inventory(
    spec: InventorySpec, source: str = "", lines: Lines | None = None
) -> Inventory:
    """Expand hostlists and apply defaults; refuse duplicates."""
    lines = lines or {}
    d = spec.defaults
    nodes: list[Node] = []
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for i, ns in enumerate(spec.nodes):
        names = hostlist.expand(ns.name)
        gpus = _gpus(ns)
        problems.extend(_entry_problems(i, ns, len(names), gpus, source, lines))
        ssh = _merge_ssh(d.ssh, ns.ssh)  # once per entry: a hostlist may name thousands
        numa = tuple(Numa(n.node, n.cpus, tuple(n.gpus)) for n in ns.numa or ())
        islands = tuple(Island(tuple(i.gpus), i.via) for i in ns.gpu_islands or ())
        slurm = ns.slurm or d.slurm or SlurmNodeSpec()
        for name in names:
            if name in seen:
                problems.append(
                    Problem(
                        f"node '{name}' is declared twice (also nodes.{seen[name]})",
                        source=source,
                        field=f"nodes.{i}.name",
                        line=lines.get(("nodes", str(i), "name")),
                    )
                )
            seen[name] = i
            nodes.append(
                Node(
                    name=name,
                    address=ns.address or name,
                    gpus=gpus,
                    slots=ns.slots,
                    gpu_link=ns.gpu_link or d.gpu_link or ("pcie" if gpus else "none"),
                    network=ns.network or d.network,
                    partition=slurm.partition,
                    gres_type=slurm.gres_type,
                    ssh=ssh,
                    python=ns.python or d.python,
                    cpus=ns.cpus or d.cpus,
                    containers=_containers(ns.containers, d.containers),
                    host_memory_gb=ns.host_memory_gb or d.host_memory_gb,
                    lease_dir=ns.lease_dir or d.lease_dir,
                    numa=numa,
                    islands=islands,
                )
            )
    if problems:
        raise UserError(problems)
    return Inventory(name=spec.name, nodes=tuple(nodes), source=source)


def _entry_problems(i: int, ns: NodeSpec, count: int, gpus: tuple[Gpu, ...], source: str,
                    lines: Lines) -> list[Problem]:
    """What is wrong with entry ``i`` itself: one address for a hostlist of ``count`` names,
    a CUDA index in two GPU groups."""
    problems = []
    if ns.address is not None and count > 1:
        problems.append(
            Problem(
                "a hostlist node cannot share one address",
                source=source,
                field=f"nodes.{i}.address",
                line=lines.get(("nodes", str(i), "address")),
                got=ns.address,
                hint="drop 'address' (each name is its own address) or list nodes singly",
            )
        )
    problems.extend(_topology_problems(i, ns, gpus, source, lines))
    indices = [g.index for g in gpus]
    if len(set(indices)) != len(indices):
        problems.append(
            Problem(
                "a CUDA index is used by two GPU groups",
                source=source,
                field=f"nodes.{i}.gpus",
                line=lines.get(("nodes", str(i), "gpus")),
                got=str(sorted(indices)),
            )
        )
    return problems


def _topology_problems(i: int, ns: NodeSpec, gpus: tuple[Gpu, ...], source: str,
                       lines: Lines) -> list[Problem]:
    """A NUMA node or island naming a GPU the node lacks, a GPU on two NUMA nodes."""
    known = {g.index for g in gpus}
    problems = []
    for key, groups in (("numa", [n.gpus for n in ns.numa or ()]),
                        ("gpu_islands", [g.gpus for g in ns.gpu_islands or ()])):
        for j, group in enumerate(groups):
            unknown = sorted(set(group) - known)
            if unknown:
                problems.append(Problem(
                    f"GPU {', '.join(map(str, unknown))} is not one of the node's GPUs",
                    source=source, field=f"nodes.{i}.{key}.{j}.gpus",
                    line=lines.get(("nodes", str(i), key, str(j), "gpus")), got=str(group)))
    listed = [g for n in ns.numa or () for g in n.gpus]
    if len(set(listed)) != len(listed):
        problems.append(Problem(
            "a GPU is on two NUMA nodes", source=source, field=f"nodes.{i}.numa",
            line=lines.get(("nodes", str(i), "numa")), got=str(sorted(listed))))
    return problems


def _gpus(ns: NodeSpec) -> tuple[Gpu, ...]:
    out: list[Gpu] = []
    next_index = 0
    for group in ns.gpus:
        indices = group.indices if group.indices is not None else list(
            range(next_index, next_index + (group.count or 0))
        )
        out.extend(Gpu(index=i, model=group.model, memory_gb=group.memory_gb,
                       tflops=group.tflops) for i in indices)
        next_index = max(indices) + 1
    return tuple(sorted(out, key=lambda g: g.index))


def _containers(own: Sequence[str] | None, default: Sequence[str] | None
                ) -> tuple[str, ...] | None:
    chosen = own if own is not None else default
    return None if chosen is None else tuple(chosen)


def _merge_ssh(default: SSHSpec | None, own: SSHSpec | None) -> SSHSpec:
    merged = dict((default or SSHSpec()).model_dump(exclude_unset=True))
    merged.update((own or SSHSpec()).model_dump(exclude_unset=True))
    return SSHSpec(**merged)
