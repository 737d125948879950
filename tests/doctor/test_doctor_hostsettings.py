"""The doctor's host checks behind NCCL's container freezes, from captured host outputs.

The fixtures are real outputs users posted (tests/doctor/hostsettings/SOURCES.md says where
each comes from); each must turn into the warning that names what to change.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrate.doctor.hostsettings import HostSettings, judge_host_settings

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "hostsettings"


def text(name: str) -> str:
    return (FIXTURES / name).read_text()


def row(host: HostSettings, name: str) -> tuple[str, str, str]:
    (found,) = [r for r in judge_host_settings("gpu1", host) if r.name == name]
    return found.status, found.detail, found.hint


def test_iommu_on_without_passthrough_warns_with_the_fix() -> None:
    status, detail, hint = row(HostSettings(cmdline=text("cmdline-intel-iommu-on.txt"),
                                            iommu_units=("dmar0", "dmar1")), "IOMMU")
    assert status == "warn"
    assert "IOMMU is on without passthrough on gpu1 (dmar0, dmar1)" in detail
    assert "iommu=pt" in hint and "BIOS" in hint and "docs/containers.md" in hint


def test_iommu_in_passthrough_or_off_passes() -> None:
    assert row(HostSettings(cmdline=text("cmdline-iommu-pt.txt"), iommu_units=("ivhd0",)),
               "IOMMU")[0] == "pass"
    assert row(HostSettings(cmdline=text("cmdline-plain.txt"), iommu_units=()),
               "IOMMU")[0] == "pass"


def test_iommu_listed_in_sysfs_is_on_even_without_a_parameter() -> None:
    status, detail, _ = row(HostSettings(cmdline=text("cmdline-plain.txt"),
                                         iommu_units=("ivhd0",)), "IOMMU")
    assert status == "warn" and "ivhd0" in detail


def test_acs_srcvalid_lines_warn_with_setpci_and_bios_advice() -> None:
    status, detail, hint = row(HostSettings(lspci=text("lspci-acsctl-nccl606.txt")), "PCIe ACS")
    assert status == "warn"
    assert "SrcValid+" in detail and "on 3 PCIe port(s)" in detail
    assert "pci=noacs" in hint and "setpci" in hint and "BIOS" in hint


def test_acs_off_passes() -> None:
    assert row(HostSettings(lspci=text("lspci-acsctl-off-nccl1405.txt")), "PCIe ACS")[0] == "pass"


def test_only_the_bridge_above_a_planned_gpu_counts() -> None:
    lspci = text("lspci-bridges.txt")
    # c7:02.0 (ACS on) is above c8:00.0; c7:03.0 (ACS off) above c9:00.0.
    status, detail, _ = row(HostSettings(lspci=lspci, gpu_bus_ids=("0000:c8:00.0",)), "PCIe ACS")
    assert status == "warn" and "0000:c7:02.0" in detail and "c7:03.0" not in detail
    assert row(HostSettings(lspci=lspci, gpu_bus_ids=("0000:c9:00.0",)), "PCIe ACS")[0] == "pass"


def test_lspci_without_root_says_acs_is_unknown() -> None:
    status, detail, hint = row(HostSettings(lspci=text("lspci-noroot-fastfetch1658.txt")),
                               "PCIe ACS")
    assert status == "warn" and "unknown" in detail and "root" in hint


def test_iommu_page_faults_in_the_kernel_log_warn_naming_the_device() -> None:
    status, detail, hint = row(HostSettings(kernel_log=text("dmesg-amdvi-cuda-samples48.txt")),
                               "IOMMU faults")
    assert status == "warn"
    assert "3 IOMMU page fault(s)" in detail and "0000:07:00.0" in detail
    assert "iommu=pt" in hint


def test_a_clean_kernel_log_passes() -> None:
    assert row(HostSettings(kernel_log=text("dmesg-clean-lake10.txt")),
               "IOMMU faults")[0] == "pass"


def test_nothing_gathered_gives_no_row() -> None:
    assert judge_host_settings("gpu1", HostSettings()) == []


def test_the_record_round_trips() -> None:
    host = HostSettings(cmdline="ro iommu=pt", iommu_units=("dmar0",), lspci="x",
                        kernel_log=None, gpu_bus_ids=("0000:07:00.0",))
    assert HostSettings.from_json(host.to_json()) == host


def test_the_static_tier_warns_on_a_gpu_node_with_the_field_notes_settings() -> None:
    """Through the doctor's static tier: a GPU node whose host shows IOMMU on, ACS on the
    bridge above its planned GPU, and IOMMU faults gets three warnings; a healthy one none."""
    from orchestrate.core.spec.inventory import InventorySpec, resolve_inventory
    from orchestrate.doctor.grading import JobShape, PlannedNode
    from orchestrate.doctor.static_tier import facts_from_json, judge_static

    inv = resolve_inventory(InventorySpec.model_validate({"name": "lab", "nodes": [
        {"name": "gpu[1-2]", "gpus": [{"model": "H100-80GB", "memory_gb": 80, "count": 1}]}]}))
    job = JobShape(tuple(PlannedNode(n.name, n, n.capacity, ("H100-80GB",), (0,), None)
                         for n in inv.nodes), "nccl", inv.nodes[0].address, 29500)
    gpu = [{"index": 0, "model": "H100-80GB", "memory_gb": 80, "bus_id": "00000000:C8:00.0"}]
    base = {"versions": {"python": "3.11.7", "torch": "2.6.0", "cuda": "12.4",
                         "nccl": "2.21.5", "driver": "550.54.15"},
            "shm_bytes": 64 << 30, "gpus": gpu}
    frozen = {"cmdline": text("cmdline-intel-iommu-on.txt"), "iommu_units": ["dmar0"],
              "lspci": text("lspci-bridges.txt"),
              "kernel_log": text("dmesg-amdvi-cuda-samples48.txt")}
    fine = {"cmdline": text("cmdline-iommu-pt.txt"), "iommu_units": ["dmar0"],
            "lspci": text("lspci-acsctl-off-nccl1405.txt"),
            "kernel_log": text("dmesg-clean-lake10.txt")}
    rows = judge_static(job, facts_from_json({"gpu1": {**base, "host_settings": frozen},
                                              "gpu2": {**base, "host_settings": fine}}))
    host_rows = [r for r in rows if r.name in ("IOMMU", "PCIe ACS", "IOMMU faults")]
    assert len(host_rows) == 6
    warned = {(r.name, r.nodes[0]) for r in host_rows if r.status == "warn"}
    assert {("IOMMU", "gpu1"), ("PCIe ACS", "gpu1"), ("IOMMU faults", "gpu1")} <= warned
    assert not any(node == "gpu2" for _, node in warned)
