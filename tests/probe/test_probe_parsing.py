"""Parsing raw facts: model names, memory, CUDA order, topology matrices, the network choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrate.probe.facts import (
    gpu_link,
    memory_gb,
    normalise_model,
    parse_facts,
    parse_gpu_query,
    parse_topo_matrix,
)
from orchestrate.probe.network import HcaPort, NicFact, choose_network
from tests.support.probemachine import FIXTURES

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("name", "gb", "model"), [
    ("NVIDIA A100-SXM4-80GB", 80, "A100-80GB"),
    ("NVIDIA A100 80GB PCIe", 80, "A100-80GB"),
    ("NVIDIA A100-PCIE-40GB", 40, "A100-40GB"),
    ("NVIDIA A100-SXM4-40GB", 40, "A100-40GB"),
    ("NVIDIA H100 80GB HBM3", 80, "H100-80GB"),
    ("NVIDIA H100 PCIe", 80, "H100-80GB"),
    ("NVIDIA H100 NVL", 94, "H100-NVL-94GB"),
    ("NVIDIA H200", 140, "H200-141GB"),
    ("NVIDIA B200", 179, "B200-180GB"),
    ("NVIDIA GH200 480GB", 96, "GH200-96GB"),  # 480GB counts the Grace CPU's memory
    ("Tesla V100-SXM2-32GB", 32, "V100-32GB"),
    ("Tesla V100-PCIE-16GB", 16, "V100-16GB"),
    ("NVIDIA RTX A6000", 48, "RTX-A6000"),
    ("NVIDIA GeForce RTX 4090", 24, "RTX-4090"),
    ("NVIDIA RTX 6000 Ada Generation", 48, "RTX-6000-Ada"),
    ("NVIDIA L40S", 45, "L40S"),
    ("NVIDIA A10G", 22, "A10G"),
    ("Tesla T4", 15, "T4"),
    ("Quadro RTX 8000", 48, "RTX-8000"),
])
def test_model_names_are_normalised_per_model(name: str, gb: float, model: str) -> None:
    assert normalise_model(name, gb) == model


def test_memory_is_rounded_the_way_inventories_write_it() -> None:
    assert [memory_gb(m) for m in (81920, 49140, 81559, 40960, 32510, 46068)] == [
        80, 48, 80, 40, 32, 45]


def test_gpus_are_numbered_in_pci_bus_order_whatever_nvidia_smi_printed() -> None:
    # Synthetic rows (no public paste shows nvidia-smi's order differing from the bus order):
    # index 0 sits on bus 0x81, after the A100 on 0x01.
    text = ("index, pci.bus_id, name, memory.total [MiB]\n"
            "0, 00000000:81:00.0, NVIDIA RTX A6000, 49140\n"
            "1, 00000000:01:00.0, NVIDIA A100 80GB PCIe, 81920\n"
            "2, 00000001:00:00.0, NVIDIA RTX A6000, 49140\n")
    gpus = parse_gpu_query(text)
    assert [(g.cuda_index, g.smi_index, g.model) for g in gpus] == [
        (0, 1, "A100-80GB"), (1, 0, "RTX-A6000"), (2, 2, "RTX-A6000")]
    assert gpus[0].uuid is None and gpus[0].pcie_gen_max is None


def test_query_rows_name_their_columns_by_the_header() -> None:
    gpus = parse_gpu_query((FIXTURES / "ambers-a100-a6000" / "query.csv").read_text())
    assert [g.model for g in gpus] == ["A100-80GB"] * 2 + ["RTX-A6000"] * 6
    a6000 = gpus[2]
    assert (a6000.memory_gb, a6000.memory_mib, a6000.driver, a6000.compute_cap) == (
        48, 49140, "550.54.15", "8.6")
    assert (a6000.pcie_gen_max, a6000.pcie_width_current, a6000.mig) == (4, 16, None)


#: nvidia-smi topo -m of a Dell C4140, 4x V100 fully meshed by NVLink without a switch;
#: verbatim (tabs) from NVIDIA/nccl-tests issue #68.
C4140 = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tmlx5_0\tCPU Affinity\tNUMA Affinity\n"
    "GPU0\t X \tNV2\tNV2\tNV2\tNODE\t0,2,4,6,8,10\t0\n"
    "GPU1\tNV2\t X \tNV2\tNV2\tNODE\t0,2,4,6,8,10\t0\n"
    "GPU2\tNV2\tNV2\t X \tNV2\tNODE\t0,2,4,6,8,10\t0\n"
    "GPU3\tNV2\tNV2\tNV2\t X \tNODE\t0,2,4,6,8,10\t0\n"
    "mlx5_0\tNODE\tNODE\tNODE\tNODE\t X \t\t\n"
)

#: 8x V100 hybrid cube mesh (NV1/NV2 to some peers, SYS to others); verbatim (spaces) from
#: NVIDIA/nccl-tests issue #29.
CUBE_MESH = """\
        GPU0    GPU1    GPU2    GPU3    GPU4    GPU5    GPU6    GPU7    mlx5_0  mlx5_1  CPU Affinity
GPU0     X      NV2     NV2     NV1     NV1     SYS     SYS     SYS     NODE    NODE    0-23,48-71
GPU1    NV2      X      NV1     NV2     SYS     NV1     SYS     SYS     NODE    NODE    0-23,48-71
GPU2    NV2     NV1      X      NV1     SYS     SYS     NV2     SYS     PIX     PIX     0-23,48-71
GPU3    NV1     NV2     NV1      X      SYS     SYS     SYS     NV2     PIX     PIX     0-23,48-71
GPU4    NV1     SYS     SYS     SYS      X      NV2     NV2     NV1     SYS     SYS     24-47,72-95
GPU5    SYS     NV1     SYS     SYS     NV2      X      NV1     NV2     SYS     SYS     24-47,72-95
GPU6    SYS     SYS     NV2     SYS     NV2     NV1      X      NV1     SYS     SYS     24-47,72-95
GPU7    SYS     SYS     SYS     NV2     NV1     NV2     NV1      X      SYS     SYS     24-47,
"""


def _gpus(n: int) -> list:  # type: ignore[type-arg]
    rows = "".join(f"{i}, 00000000:{16 * (i + 1):02X}:00.0, Tesla V100-SXM2-32GB, 32510\n"
                   for i in range(n))
    return parse_gpu_query("index, pci.bus_id, name, memory.total [MiB]\n" + rows)


def _box(name: str) -> tuple[list, str]:  # type: ignore[type-arg]
    folder = FIXTURES / name
    return parse_gpu_query((folder / "query.csv").read_text()), (folder / "topo.txt").read_text()


def test_topology_cells_are_read_from_tabs_and_from_spaces() -> None:
    tabs = parse_topo_matrix(C4140)
    assert tabs[(0, 1)] == "NV2" and tabs[(3, 3)] == "X" and len(tabs) == 16
    spaces = parse_topo_matrix(_box("a100-nvlink-pairs")[1])
    assert spaces[(0, 1)] == "NV12" and spaces[(0, 2)] == "NODE" and spaces[(7, 0)] == "SYS"
    nics = parse_topo_matrix(_box("ambers-a100-a6000")[1])  # NIC rows and columns skipped
    assert len(nics) == 64 and nics[(6, 7)] == "SYS"


def test_all_pairs_through_a_switch_is_nvswitch() -> None:
    link = gpu_link(*_box("h100-nvswitch"))
    assert link.link == "nvswitch"
    assert link.detail == "NV18 between all 8 GPUs (NVSwitch)"
    assert len(link.nvlinks) == 28


def test_nvlink_pairs_are_recorded_in_cuda_indices() -> None:
    link = gpu_link(*_box("a100-nvlink-pairs"))
    assert link.link == "nvlink"
    assert link.detail == "NV12 pairs 0-1, 2-3, 4-5, 6-7; others NODE/SYS"
    assert link.nvlinks == ((0, 1, 12), (2, 3, 12), (4, 5, 12), (6, 7, 12))


def test_a_direct_mesh_is_nvlink_not_nvswitch() -> None:
    link = gpu_link(_gpus(4), C4140)
    assert (link.link, link.detail) == ("nvlink", "NV2 between all 4 GPUs (direct)")


def test_a_hybrid_cube_mesh_lists_its_pairs() -> None:
    link = gpu_link(_gpus(8), CUBE_MESH)
    assert link.link == "nvlink"
    assert link.detail.startswith("NV1 pairs 0-3, 0-4, 1-2, 1-5,")
    assert len(link.nvlinks) == 16


def test_pcie_only_and_single_gpu() -> None:
    assert gpu_link(*_box("ambers-a100-a6000")).link == "pcie"
    assert gpu_link(_gpus(1), C4140).link == "pcie"
    assert gpu_link([], None).link == "none"
    assert gpu_link(_gpus(2), None).detail.startswith("no topology")


def test_topology_pairs_follow_cuda_order_not_nvidia_smi_order() -> None:
    # Synthetic: nvidia-smi index 0 is on the later bus, so its NVLink partner (index 2) pairs
    # with CUDA 1.
    gpus = parse_gpu_query("index, pci.bus_id, name, memory.total [MiB]\n"
                           "0, 00000000:81:00.0, NVIDIA A100 80GB PCIe, 81920\n"
                           "1, 00000000:01:00.0, NVIDIA A100 80GB PCIe, 81920\n"
                           "2, 00000000:C1:00.0, NVIDIA A100 80GB PCIe, 81920\n")
    topo = ("\tGPU0\tGPU1\tGPU2\n"
            "GPU0\t X \tSYS\tNV12\n"
            "GPU1\tSYS\t X \tSYS\n"
            "GPU2\tNV12\tSYS\t X \n")
    assert gpu_link(gpus, topo).nvlinks == ((1, 2, 12),)


def _nic(name: str, kind: str = "physical", speed: int | None = 10000, up: bool = True,
         addresses: tuple[str, ...] = ()) -> NicFact:
    return NicFact(name, "up" if up else "down", speed, 1500, kind, addresses)  # type: ignore[arg-type]


VIRTUALS = (_nic("docker0", "bridge"), _nic("veth1", "virtual"), _nic("lo", "loopback", None))


def test_without_routes_the_fastest_physical_nic_up_wins_never_a_virtual_one() -> None:
    nics = (*VIRTUALS, _nic("eno1", speed=10000), _nic("eno2", speed=25000, up=False),
            _nic("eno3", speed=1000))
    network, note = choose_network(nics, (), {})
    assert network is not None
    assert (network.interface, network.fabric, network.gbps, network.hca) == (
        "eno1", "ethernet", 10, None)
    assert "fastest physical" in note
    assert choose_network(VIRTUALS, (), {}) == (None, "no physical network interface is up")


def test_the_route_to_the_peers_wins_even_over_a_faster_nic() -> None:
    nics = (*VIRTUALS, _nic("eno1", speed=100000), _nic("eth1", speed=10000))
    network, note = choose_network(nics, (), {"10.0.0.2": "eth1", "10.0.0.3": "eth1"})
    assert network is not None and network.interface == "eth1" and network.gbps == 10
    assert note == "eth1 carries the route to the other nodes"
    # A container's veth that routes to the peers is that host's network.
    network, _ = choose_network(nics, (), {"10.0.0.2": "veth1"})
    assert network is not None and network.interface == "veth1"


def test_a_route_through_a_bridge_or_loopback_is_not_used() -> None:
    nics = (*VIRTUALS, _nic("eno1", speed=25000))
    network, note = choose_network(nics, (), {"172.17.0.3": "docker0"})
    assert network is not None and network.interface == "eno1"
    assert "bridge docker0" in note
    network, _ = choose_network(nics, (), {"127.0.0.1": "lo"})
    assert network is not None and network.interface == "eno1"


def test_active_infiniband_sets_the_fabric_and_hcas() -> None:
    hcas = (HcaPort("mlx5_0", 1, True, "4: ACTIVE", 400, "InfiniBand", ("ib0",)),
            HcaPort("mlx5_1", 1, True, "4: ACTIVE", 400, "InfiniBand", ("ib1",)),
            HcaPort("mlx5_2", 1, False, "1: DOWN", 10, "InfiniBand", ()))
    nics = (_nic("eno1", speed=1000), _nic("ib0", "infiniband", None), *VIRTUALS)
    network, _ = choose_network(nics, hcas, {})
    assert network is not None
    assert (network.interface, network.fabric, network.gbps, network.hca) == (
        "ib0", "infiniband", 400, "mlx5_0,mlx5_1")
    # Bootstrap over ethernet still keeps NCCL on InfiniBand.
    network, _ = choose_network(nics, hcas, {"10.0.0.2": "eno1"})
    assert network is not None and (network.interface, network.fabric) == ("eno1", "infiniband")


def test_an_hca_with_an_ethernet_link_layer_is_roce() -> None:
    hcas = (HcaPort("mlx5_0", 1, True, "4: ACTIVE", 100, "Ethernet", ("ens1f0np0",)),)
    nics = (_nic("ens1f0np0", speed=100000), _nic("eno1", speed=1000))
    network, _ = choose_network(nics, hcas, {})
    assert network is not None
    assert (network.interface, network.fabric, network.gbps, network.hca) == (
        "ens1f0np0", "roce", 100, "mlx5_0")


def test_parse_facts_of_a_failing_and_a_missing_nvidia_smi() -> None:
    failed = parse_facts({"hostname": "gpu3", "nvidia_smi": {
        "status": "failed", "error": "Failed to initialize NVML: Driver/library version mismatch"}})
    assert failed.gpu_status == "failed" and failed.gpus == ()
    assert failed.problems == (
        "nvidia-smi failed: Failed to initialize NVML: Driver/library version mismatch",)
    missing = parse_facts({"hostname": "cpu1", "nvidia_smi": {"status": "missing"},
                           "cpus": {"count": 8, "usable": 6}, "memory_kib": 32 * 1024 * 1024})
    assert (missing.gpu_status, missing.cpus, missing.memory_gb, missing.problems) == (
        "missing", 6, 32, ())
    empty = parse_facts({"nvidia_smi": {"status": "ok", "query": "index, name\n"}})
    assert (empty.gpu_status, empty.gpu_error) == ("failed", "nvidia-smi listed no GPU")


def test_fixture_sources_are_noted(tmp_path: Path) -> None:
    for folder in FIXTURES.iterdir():
        if folder.is_dir():
            source = (folder / "SOURCE.md").read_text()
            assert "https://github.com/" in source, folder
