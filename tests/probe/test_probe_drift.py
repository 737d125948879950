"""``inventory check``: a probed inventory, edited the way reality drifts, names each difference."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import socket
from pathlib import Path

import pytest

from orchestrate.core.spec.inventory import load_inventory
from orchestrate.probe.drift import node_drift
from orchestrate.probe.facts import parse_facts
from orchestrate.probe.gathering import Unreachable
from orchestrate.probe.machine import gather_local
from orchestrate.probe.write import check
from tests.support.probemachine import cli, machine

pytestmark = pytest.mark.process

CHECK = ("inventory", "check", "--no-torch")


@pytest.fixture()
def lab(tmp_path: Path) -> Path:
    """An inventory probed from the mixed A100/A6000 server, as `probe --local` writes it."""
    path = tmp_path / "lab.yaml"
    with machine(tmp_path, "ambers-a100-a6000"):
        result = cli("inventory", "probe", "--local", "--no-torch", "-o", path)
    assert result.code == 0, result.err
    return path


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in\n{text}"
    path.write_text(text.replace(old, new))


def test_a_fresh_probe_matches(tmp_path: Path, lab: Path) -> None:
    with machine(tmp_path, "ambers-a100-a6000"):
        result = cli(*CHECK, lab)
    assert (result.code, result.out) == (0, f"{lab}: all 1 node(s) match\n")


def test_a_slower_nic_and_a_missing_gpu_are_each_named(tmp_path: Path, lab: Path) -> None:
    edit(lab, "gbps: 10}", "gbps: 100}")
    edit(lab, "indices: [2, 3, 4, 5, 6, 7]", "indices: [2, 3, 4, 5, 6, 7, 8]")
    with machine(tmp_path, "ambers-a100-a6000"):
        result = cli(*CHECK, lab)
    assert result.code == 1
    assert result.out.splitlines() == [
        "localhost: gpus: GPU 8 (RTX-A6000, 48 GB) is declared but not found; nvidia-smi "
        "lists 8 GPU(s)",
        "localhost: network.gbps: eno1 runs at 10 Gb/s, the inventory says 100 Gb/s",
        f"2 difference(s) on 1 node(s) of {lab}",
    ]


def test_json_lists_the_differences(tmp_path: Path, lab: Path) -> None:
    edit(lab, "gbps: 10}", "gbps: 100}")
    with machine(tmp_path, "ambers-a100-a6000"):
        result = cli(*CHECK, "--json", lab)
    assert result.code == 1
    report = json.loads(result.out)
    assert report["ok"] is False and report["nodes"] == ["localhost"]
    assert report["differences"] == [{
        "node": "localhost", "field": "network.gbps", "declared": "100", "found": "10",
        "message": "localhost: network.gbps: eno1 runs at 10 Gb/s, the inventory says 100 Gb/s",
    }]


def test_other_gpus_link_and_driver(tmp_path: Path, lab: Path) -> None:
    """The inventory of the A100/A6000 server checked on the H100 box: every field differs."""
    with machine(tmp_path, "h100-nvswitch"):
        result = cli(*CHECK, lab)
    assert result.code == 1
    lines = result.out.splitlines()
    assert "localhost: gpus: GPU 0 is H100-80GB (NVIDIA H100 80GB HBM3), the inventory says " \
           "A100-80GB" in lines
    assert "localhost: gpus: GPU 7 is H100-80GB (NVIDIA H100 80GB HBM3), the inventory says " \
           "RTX-A6000" in lines
    assert "localhost: gpu_link: the GPUs are linked by nvswitch (NV18 between all 8 GPUs " \
           "(NVSwitch)), the inventory says pcie" in lines
    assert "localhost: network.gbps: eno1 runs at 1 Gb/s, the inventory says 10 Gb/s" in lines
    assert "localhost: driver: NVIDIA driver 560.35.03, probed with 550.54.15 (" in \
        "\n".join(lines)
    assert any(line.startswith("localhost: pcie: the GPUs' links can do PCIe Gen5 x16 now, "
                               "PCIe Gen4 x16 when probed") for line in lines)


def test_a_gpu_on_another_numa_node_and_other_cpus(tmp_path: Path, lab: Path) -> None:
    """What placement and binding go by: each GPU's NUMA node and each node's CPUs."""
    edit(lab, '{node: 1, cpus: "56-111,168-223", gpus: [4, 5, 6, 7]}',
         '{node: 1, cpus: "56-111", gpus: [5, 6, 7]}')
    edit(lab, '{node: 0, cpus: "0-55,112-167", gpus: [0, 1, 2, 3]}',
         '{node: 0, cpus: "0-55,112-167", gpus: [0, 1, 2, 3, 4]}')
    with machine(tmp_path, "ambers-a100-a6000"):
        result = cli(*CHECK, lab)
    assert result.code == 1
    lines = result.out.splitlines()
    assert "localhost: numa: NUMA node 1 has CPUs 56-111,168-223, the inventory says 56-111" \
        in lines
    assert "localhost: numa: GPU 4 is on NUMA node 1, the inventory says 0" in lines


def test_memory_that_differs(tmp_path: Path, lab: Path) -> None:
    edit(lab, "{model: A100-80GB, memory_gb: 80,", "{model: A100-80GB, memory_gb: 40,")
    with machine(tmp_path, "ambers-a100-a6000"):
        result = cli(*CHECK, lab)
    assert result.code == 1
    assert "localhost: gpus: GPU 0 (A100-80GB) has 80 GB, the inventory says 40 GB" in result.out
    assert "GPU 1 (A100-80GB) has 80 GB" in result.out


def test_a_nic_that_is_down_and_one_that_is_gone(tmp_path: Path, lab: Path) -> None:
    with machine(tmp_path, "ambers-a100-a6000") as sysfs:
        (sysfs / "class" / "net" / "eno1" / "operstate").write_text("down\n")
        (sysfs / "class" / "net" / "eno1" / "speed").unlink()  # unreadable when down
        down = cli(*CHECK, lab)
    assert down.code == 1
    assert "localhost: network.interface: eno1 is down (operstate down)" in down.out
    edit(lab, "interface: eno1", "interface: enp65s0")
    with machine(tmp_path, "ambers-a100-a6000"):
        gone = cli(*CHECK, lab)
    assert "localhost: network.interface: enp65s0 does not exist on " in gone.out


def test_a_failing_nvidia_smi_and_a_host_without_one(tmp_path: Path, lab: Path) -> None:
    with machine(tmp_path, "driver-mismatch"):
        failing = cli(*CHECK, lab)
    assert failing.code == 1
    assert "localhost: gpus: nvidia-smi failed: Failed to initialize NVML: Driver/library " \
           "version mismatch" in failing.out
    with machine(tmp_path, "cpu"):
        missing = cli(*CHECK, lab)
    assert "localhost: gpus: 8 GPU(s) declared, but the host has no nvidia-smi " \
           "(nvidia-smi not found on PATH)" in missing.out


def test_an_unreachable_node_is_drift(tmp_path: Path, lab: Path) -> None:
    inv = load_inventory(lab)
    report = check(inv, lab.read_text(), str(lab),
                   {"localhost": Unreachable("ssh: connect timed out after 10s")})
    assert report.status == 1


def test_a_pcie_link_below_its_width_or_generation(tmp_path: Path, lab: Path) -> None:
    with machine(tmp_path, "ambers-a100-a6000"):
        facts = parse_facts(gather_local(torch=False))
    node = load_inventory(lab).nodes[0]
    narrow = dataclasses.replace(facts.gpus[3], pcie_width_current=8)
    idle = dataclasses.replace(facts.gpus[4], pcie_gen_current=1, utilization=0.0)
    busy = dataclasses.replace(facts.gpus[5], pcie_gen_current=3, utilization=97.0)
    gpus = (*facts.gpus[:3], narrow, idle, busy, *facts.gpus[6:])
    found = node_drift(node, dataclasses.replace(facts, gpus=gpus))
    assert [d.message for d in found] == [
        "localhost: pcie: GPU 3's PCIe link runs at x8 of x16 (reseat the card, or check the "
        "slot)",
        "localhost: pcie: GPU 5's PCIe link runs at Gen3 of Gen4 while the GPU works "
        "(97% busy)",
    ]  # GPU 4 idles at Gen1: power saving, not a fault


def test_check_reaches_other_nodes_over_ssh_and_names_one_it_cannot_reach(
    tmp_path: Path,
) -> None:
    # gpu01 is another machine: check logs into it over SSH with the file's settings. Its
    # ssh_config sends it to a loopback port nobody listens on (no traffic leaves this host).
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    config = tmp_path / "ssh_config"
    config.write_text(f"Host gpu01\n    HostName 127.0.0.1\n    Port {port}\n")
    path = tmp_path / "remote.yaml"
    path.write_text(f"name: remote\ndefaults:\n  ssh: {{config_file: {config}, "
                    "connect_timeout_s: 5}\nnodes:\n  - name: gpu01\n    slots: 2\n")
    result = cli(*CHECK, path)
    assert result.code == 1, result.err
    assert result.out.startswith(f"gpu01: could not be probed: unreachable: 127.0.0.1:{port}: ")
    assert "refused" in result.out.lower()


@pytest.mark.unit
def test_a_broken_file_is_a_user_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: broken\nnodes:\n  - name: localhost\n    gpuz: 2\n")
    result = cli(*CHECK, path)
    assert result.code == 2
    assert "broken.yaml:4: nodes.0.gpuz: unknown key" in result.err


def test_a_torch_or_driver_change_since_the_probe(tmp_path: Path) -> None:
    path = tmp_path / "lab.yaml"
    with machine(tmp_path, "ambers-a100-a6000"):
        assert cli("inventory", "probe", "--local", "-o", path).code == 0
        assert cli("inventory", "check", path).code == 0
        version = importlib.metadata.version("torch")
        edit(path, f"torch {version}", "torch 2.12.0+cu126")
        edit(path, "driver 550.54.15", "driver 535.129.03")
        result = cli("inventory", "check", path)
    assert result.code == 1
    lines = result.out.splitlines()
    assert lines[0].startswith("localhost: driver: NVIDIA driver 550.54.15, probed with "
                               "535.129.03 (")
    assert lines[1].startswith(f"localhost: torch: torch {version}, probed with 2.12.0+cu126 (")
