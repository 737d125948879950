"""What a host's raw facts mean: its GPUs in CUDA order, their link, its network.

:func:`parse_facts` turns the dict :func:`orchestrate.hostside.hostfacts.gather` collects on a
host into :class:`ProbedHost`, the values an inventory is written from and checked against (and
local planning, and the doctor's static tier, read). Pure: text and dicts in, values out, so the
real ``nvidia-smi`` outputs of machines we do not have (captured from public reports, in
tests/probe/fixtures) can be replayed exactly.

The knowledge people get wrong by hand lives here:

- CUDA numbers GPUs by PCI bus id under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (orchestrate always
  sets it), so GPUs are sorted by ``pci.bus_id``, whatever order ``nvidia-smi`` printed;
- model names are normalised per GPU, not taken from GPU 0 (``NVIDIA RTX A6000`` is
  ``RTX-A6000``, not Ray's ``RTX``), and memory variants stay apart (``A100-40GB``,
  ``A100-80GB``) while form factors merge (SXM4 and PCIe A100-80GB are one model);
- ``nvidia-smi topo -m`` cells ``NV#`` become ``nvswitch`` (more links per GPU than a GPU has
  ports: they go through a switch), ``nvlink`` (some pairs; recorded in CUDA indices) or ``pcie``;
- the network is the interface that routes to the other nodes, never a bridge or loopback, and
  its fabric comes from the InfiniBand HCAs behind it (:mod:`orchestrate.probe.network`).
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from orchestrate.core.spec.inventory import GpuLink, Island, NetworkSpec, Numa
from orchestrate.hostside import smi
from orchestrate.probe.network import HcaPort, NicFact, choose_network, hcas_of, nics_of
from orchestrate.probe.topology import islands, numa_facts

GpuStatus = Literal["ok", "missing", "failed"]

#: The most NVLinks one GPU has (H100, H200, B200: 18). A GPU showing more links to its peers
#: in total reaches them through NVSwitches (8x A100: NV12 to each of 7 peers = 84 > 18), while
#: direct meshes stay within it (4x V100 NV2: 6; HGX H100 4-GPU NV6: 18).
MAX_NVLINKS_PER_GPU = 18

#: Words of a product name that say nothing about the GPU's model: vendor, brand, form factor,
#: memory technology.
_NOISE = frozenset({
    "NVIDIA", "TESLA", "QUADRO", "GEFORCE", "SXM", "SXM2", "SXM3", "SXM4", "SXM5", "SXM6",
    "PCIE", "HBM2", "HBM2E", "HBM3", "HBM3E", "GENERATION", "EDITION", "WORKSTATION", "SERVER",
})

#: Families sold with several memory sizes (GB, as marketed): their model names carry the size
#: (``A100-40GB`` and ``A100-80GB`` are different GPUs to a job). The size comes from the name
#: when it says one, else the nearest of these to ``memory.total``.
MEMORY_VARIANTS: dict[str, tuple[int, ...]] = {
    "A100": (40, 80), "A800": (40, 80), "H100": (80, 94, 96), "H800": (80,), "H200": (141,),
    "H20": (96,), "GH200": (96, 144), "B100": (192,), "B200": (180, 192), "GB200": (186,),
    "B300": (288,), "V100": (16, 32), "V100S": (32,), "P100": (12, 16),
}

_GB_WORD = re.compile(r"^(\d+)GB$", re.IGNORECASE)
_GPU_LABEL = re.compile(r"GPU\d+")
_NVLINK_CELL = re.compile(r"NV(\d+)")


@functools.lru_cache(maxsize=256)
def normalise_model(name: str, memory_gb: float | None = None) -> str:
    """A short, stable model name for an ``nvidia-smi`` product name.

    ``NVIDIA A100-SXM4-80GB`` and ``NVIDIA A100 80GB PCIe`` -> ``A100-80GB``; ``NVIDIA H100 80GB
    HBM3`` -> ``H100-80GB``; ``NVIDIA H100 PCIe`` (81559 MiB) -> ``H100-80GB``; ``NVIDIA RTX
    A6000`` -> ``RTX-A6000``; ``NVIDIA GeForce RTX 4090`` -> ``RTX-4090``; ``Tesla
    V100-SXM2-32GB`` -> ``V100-32GB``; ``NVIDIA L40S`` -> ``L40S``; ``NVIDIA RTX 6000 Ada
    Generation`` -> ``RTX-6000-Ada``.
    """
    words = [w for w in re.split(r"[\s\-_]+", name.strip()) if w]
    size: int | None = None
    kept: list[str] = []
    for word in words:
        found = _GB_WORD.match(word)
        if found:
            size = int(found.group(1))
        elif word.upper() not in _NOISE:
            kept.append(word)
    if not kept:
        return "-".join(words) or "unknown"
    family = kept[0].upper()
    sizes = MEMORY_VARIANTS.get(family)
    if sizes is not None:
        # A size in the name that is far from the GPU's memory is not the GPU's (GH200 480GB
        # counts the CPU's memory too): then the nearest marketed size wins.
        if memory_gb and (size is None or abs(size - memory_gb) > 0.15 * size):
            size = min(sizes, key=lambda s: abs(s - memory_gb))
        if size is not None:
            kept.append(f"{size}GB")
    # A size on a single-size product (a card's name saying 48GB) adds nothing: dropped.
    return "-".join(kept)


def memory_gb(mib: float) -> float:
    """``memory.total`` (MiB) in the GB inventories write: 81920 -> 80, 49140 -> 48."""
    return float(round(mib / 1024))


@dataclass(frozen=True)
class GpuFact:
    """One GPU as ``nvidia-smi`` reported it; ``cuda_index`` is its place in PCI bus order.

    The one GPU record: inventory files, drift, local planning and the doctor's static tier
    all read GPUs as this."""

    cuda_index: int
    smi_index: int | None
    bus_id: str
    name: str
    model: str
    memory_gb: float
    memory_mib: float | None = None
    uuid: str | None = None
    driver: str | None = None
    compute_cap: str | None = None
    pcie_gen_max: int | None = None
    pcie_gen_current: int | None = None
    pcie_width_max: int | None = None
    pcie_width_current: int | None = None
    utilization: float | None = None
    mig: str | None = None


@dataclass(frozen=True)
class LinkFact:
    """How the GPUs of a node reach each other.

    ``nvlinks`` holds every NVLink-connected pair as (CUDA index, CUDA index, links)."""

    link: GpuLink
    detail: str
    nvlinks: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class ProbedHost:
    """Everything the inventory needs from one host, parsed."""

    hostname: str
    time: float | None
    gpu_status: GpuStatus
    gpu_error: str | None
    gpus: tuple[GpuFact, ...]
    link: LinkFact
    nics: tuple[NicFact, ...]
    hcas: tuple[HcaPort, ...]
    network: NetworkSpec | None
    network_note: str
    cpus: int | None
    memory_gb: float | None
    python: str | None
    python_version: str | None
    torch: str | None
    torch_cuda: str | None
    nccl: str | None
    torch_error: str | None
    shm_bytes: int | None = None
    memlock: Any = None
    problems: tuple[str, ...] = field(default_factory=tuple)
    containers: tuple[str, ...] | None = None  # container runtimes found (None: not asked)
    numa: tuple[Numa, ...] = ()  # NUMA nodes with CPUs and GPUs (fewer than two: none)
    islands: tuple[Island, ...] = ()  # GPUs under one PCIe switch or joined by NVLink

    @property
    def driver(self) -> str | None:
        """The NVIDIA driver version, if GPUs were found."""
        return next((g.driver for g in self.gpus if g.driver), None)

    def nic(self, name: str) -> NicFact | None:
        """The interface called ``name``, if the host has it."""
        return next((n for n in self.nics if n.name == name), None)

    def pcie(self) -> str | None:
        """The GPUs' PCIe link capability, e.g. ``PCIe Gen5 x16`` (``Gen4 x16/x8`` if mixed)."""
        gens = sorted({g.pcie_gen_max for g in self.gpus if g.pcie_gen_max}, reverse=True)
        widths = sorted({g.pcie_width_max for g in self.gpus if g.pcie_width_max}, reverse=True)
        if not gens and not widths:
            return None
        gen = "/".join(f"Gen{g}" for g in gens) or "Gen?"
        width = "/".join(f"x{w}" for w in widths) or "x?"
        return f"PCIe {gen} {width}"


# ---------------------------------------------------------------------------------------- GPUs


def _integer(text: str | None) -> int | None:
    number = smi.number(text)
    return None if number is None else int(number)


def _bus_key(bus_id: str) -> tuple[int, ...]:
    """``00000000:1B:00.0`` as numbers: domain, bus, device, function (the order CUDA uses)."""
    parts = re.split(r"[:.]", bus_id.strip())
    try:
        return tuple(int(p, 16) for p in parts)
    except ValueError:
        return (1 << 62,)


def parse_gpu_query(text: str, fields: list[str] | None = None) -> list[GpuFact]:
    """The rows of ``nvidia-smi --query-gpu=... --format=csv[,nounits]``, in PCI bus order.

    The header names the columns (``memory.total [MiB]`` included); without one, ``fields``
    does. Rows come back sorted by bus id, each with its CUDA index under PCI_BUS_ID order.
    """
    rows_parsed = smi.rows(text, fields)
    rows_parsed.sort(key=lambda r: _bus_key(r.get("pci.bus_id") or ""))
    gpus = []
    for cuda, row in enumerate(rows_parsed):
        name = smi.value(row.get("name")) or "unknown"
        mib = smi.number(row.get("memory.total"))
        gb = memory_gb(mib) if mib else 0.0
        gpus.append(GpuFact(
            cuda_index=cuda,
            smi_index=_integer(row.get("index")),
            bus_id=(row.get("pci.bus_id") or "").strip(),
            name=name,
            model=normalise_model(name, gb or None),
            memory_gb=gb,
            memory_mib=mib,
            uuid=smi.value(row.get("uuid")),
            driver=smi.value(row.get("driver_version")),
            compute_cap=smi.value(row.get("compute_cap")),
            pcie_gen_max=_integer(row.get("pcie.link.gen.max")),
            pcie_gen_current=_integer(row.get("pcie.link.gen.current")),
            pcie_width_max=_integer(row.get("pcie.link.width.max")),
            pcie_width_current=_integer(row.get("pcie.link.width.current")),
            utilization=smi.number(row.get("utilization.gpu")),
            mig=smi.value(row.get("mig.mode.current")),
        ))
    return gpus


# ------------------------------------------------------------------------------------ topology


def parse_topo_matrix(text: str) -> dict[tuple[int, int], str]:
    """The GPU-to-GPU cells of ``nvidia-smi topo -m`` by (nvidia-smi index, index).

    Works on the tab-separated output and on copies whose tabs became spaces: only the GPU
    columns are read (NIC columns, ``CPU Affinity`` and the legend are ignored)."""
    cells: dict[tuple[int, int], str] = {}
    columns: list[int] = []
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if not columns and words[0] == "GPU0" and (len(words) == 1 or words[1] != "X"):
            # the header (GPU0 GPU1 ... NIC0 ... CPU Affinity); GPU0's own row starts "GPU0 X"
            columns = [int(w[3:]) for w in words if _GPU_LABEL.fullmatch(w)]
            continue
        if columns and _GPU_LABEL.fullmatch(words[0]):
            row = int(words[0][3:])
            for col, cell in zip(columns, words[1:], strict=False):
                cells[(row, col)] = cell
        elif columns and words[0].startswith("Legend"):
            break
    return cells


def gpu_link(gpus: tuple[GpuFact, ...] | list[GpuFact], topo: str | None) -> LinkFact:
    """nvswitch / nvlink (which pairs) / pcie for a node's GPUs from its topology matrix."""
    if not gpus:
        return LinkFact("none", "no GPU")
    if topo is None:
        return LinkFact("pcie", "no topology (nvidia-smi topo -m failed); assumed PCIe")
    if len(gpus) == 1:
        return LinkFact("pcie", "one GPU")
    cuda_of = {g.smi_index: g.cuda_index for g in gpus if g.smi_index is not None}
    cells = parse_topo_matrix(topo)
    kinds: Counter[str] = Counter()
    nvlinks: dict[tuple[int, int], int] = {}
    for (a, b), cell in cells.items():
        if a == b or a not in cuda_of or b not in cuda_of:
            continue
        found = _NVLINK_CELL.fullmatch(cell)
        if found:
            pair = tuple(sorted((cuda_of[a], cuda_of[b])))
            nvlinks[(pair[0], pair[1])] = int(found.group(1))
        else:
            kinds[cell] += 1
    n = len(gpus)
    pairs = tuple(sorted((a, b, k) for (a, b), k in nvlinks.items()))
    if not nvlinks:
        if not kinds:
            return LinkFact("pcie", "no GPU pairs in nvidia-smi topo -m; assumed PCIe")
        return LinkFact("pcie", "no NVLink (" + "/".join(sorted(kinds)) + ")")
    if len(nvlinks) == n * (n - 1) // 2:
        per_gpu = [sum(k for (a, b), k in nvlinks.items() if i in (a, b)) for i in range(n)]
        counts = sorted({k for _, _, k in pairs})
        label = "/".join(f"NV{k}" for k in counts)
        if min(per_gpu) > MAX_NVLINKS_PER_GPU:
            return LinkFact("nvswitch", f"{label} between all {n} GPUs (NVSwitch)", pairs)
        return LinkFact("nvlink", f"{label} between all {n} GPUs (direct)", pairs)
    by_count: dict[int, list[str]] = {}
    for a, b, k in pairs:
        by_count.setdefault(k, []).append(f"{a}-{b}")
    detail = "; ".join(f"NV{k} pairs {', '.join(p)}" for k, p in sorted(by_count.items()))
    others = "/".join(sorted(kinds))
    return LinkFact("nvlink", detail + (f"; others {others}" if others else ""), pairs)


# --------------------------------------------------------------------------------------- facts


def _get(raw: Mapping[str, Any], *keys: str) -> Any:
    value: Any = raw
    for key in keys:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def parse_facts(raw: Mapping[str, Any]) -> ProbedHost:
    """Parse what :func:`orchestrate.hostside.hostfacts.gather` returned on one host."""
    problems: list[str] = []
    asked = _get(raw, "nvidia_smi") or {}
    said = asked.get("status")
    status: GpuStatus = "ok" if said == "ok" else "failed" if said == "failed" else "missing"
    gpus: tuple[GpuFact, ...] = ()
    error = asked.get("error")
    if status == "ok":
        gpus = tuple(parse_gpu_query(asked.get("query") or "", asked.get("fields")))
        if not gpus:
            status, error = "failed", "nvidia-smi listed no GPU"
    if status == "failed":
        problems.append(f"nvidia-smi failed: {error}")
    link = gpu_link(gpus, asked.get("topo"))
    numa, joined = _placement_facts(gpus, asked.get("topo"), _get(raw, "numa") or {})
    if gpus and asked.get("topo_error"):
        problems.append(f"nvidia-smi topo -m failed: {asked.get('topo_error')}")
    raw_hcas = _get(raw, "net", "infiniband") or []
    hcas = hcas_of(raw_hcas)
    nics = nics_of(_get(raw, "net", "interfaces") or [])
    routes = {
        str(peer): str(found["interface"])
        for peer, found in (_get(raw, "routes") or {}).items()
        if isinstance(found, Mapping) and found.get("interface")
    }
    for peer, found in (_get(raw, "routes") or {}).items():
        if isinstance(found, Mapping) and found.get("error"):
            problems.append(f"route to {peer}: {found['error']}")
    network, note = choose_network(nics, hcas, routes)
    torch = _get(raw, "torch")
    torch_error = torch.get("error") if isinstance(torch, Mapping) else None
    cpus = _get(raw, "cpus", "usable") or _get(raw, "cpus", "count")
    kib = _get(raw, "memory_kib")
    return ProbedHost(
        hostname=str(raw.get("hostname") or "?"),
        time=raw.get("time"),
        gpu_status=status,
        gpu_error=error if status != "ok" else None,
        gpus=gpus,
        link=link,
        nics=nics,
        hcas=hcas,
        network=network,
        network_note=note,
        cpus=int(cpus) if cpus else None,
        memory_gb=float(round(kib / 1024 / 1024)) if kib else None,
        python=_get(raw, "python", "executable"),
        python_version=_get(raw, "python", "version"),
        torch=torch.get("version") if isinstance(torch, Mapping) else None,
        torch_cuda=torch.get("cuda") if isinstance(torch, Mapping) else None,
        nccl=torch.get("nccl") if isinstance(torch, Mapping) else None,
        torch_error=torch_error,
        shm_bytes=_get(raw, "shm_bytes"),
        memlock=_get(raw, "memlock"),
        problems=tuple(problems),
        containers=None if raw.get("containers") is None
        else tuple(str(c) for c in raw["containers"]),
        numa=numa,
        islands=joined,
    )


def _placement_facts(gpus: tuple[GpuFact, ...], topo: str | None, sysfs: Mapping[str, str]
                     ) -> tuple[tuple[Numa, ...], tuple[Island, ...]]:
    """The GPUs' NUMA nodes and islands (:mod:`orchestrate.probe.topology`); none on a CPU
    node (its ranks have no GPU to sit beside)."""
    if not gpus:
        return (), ()
    cuda_of = {g.smi_index: g.cuda_index for g in gpus if g.smi_index is not None}
    return (numa_facts(cuda_of, topo, sysfs),
            islands(cuda_of, parse_topo_matrix(topo)) if topo else ())
