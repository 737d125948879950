"""This machine as the local backend plans it: the same node ``inventory probe --local`` writes.

Each captured machine is stood in (its nvidia-smi outputs replayed on PATH, its sysfs tree) and
the local inventory is built for real; it must equal the node that ``probe --local`` writes for
the same machine (less the network, which a local job's ranks do not use: they meet at
127.0.0.1), so local planning, inventory files and the doctor cannot disagree.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from orchestrate.core.spec.inventory import Gpu, load_inventory
from orchestrate.doctor.floors import intra_node_floor
from orchestrate.probe.machine import local_inventory, probe_gpus
from tests.support.probemachine import cli, machine

pytestmark = pytest.mark.process  # the stand-in nvidia-smi is a process

BOXES = ["h100-nvswitch", "a100-nvlink-pairs", "ambers-a100-a6000", "cpu"]


@pytest.mark.parametrize("box", BOXES)
def test_the_local_inventory_is_the_probed_node(tmp_path: Path, box: str) -> None:
    with machine(tmp_path, box):
        here = local_inventory()
        written = cli("inventory", "probe", "--local", "--no-torch", "-o", tmp_path / "p.yaml")
    assert written.code == 0, written.err
    probed = load_inventory(tmp_path / "p.yaml").nodes[0]
    assert probed.network is not None  # probe records it; the local node leaves it out
    assert here.nodes == (dataclasses.replace(probed, network=None),)


def test_an_h100_job_without_inventory_plans_under_the_probes_model(tmp_path: Path) -> None:
    """The reproduced bug: the model was the raw ``NVIDIA-H100-80GB-HBM3``, so a job asking
    for ``H100-80GB`` (what ``probe`` writes) was refused."""
    job = tmp_path / "job.yaml"
    job.write_text("name: h100\nbackend: local\n"
                   "resources: {nodes: 1, gpus_per_node: 8, gpu_model: H100-80GB}\n"
                   "command: [python, -c, pass]\n")
    with machine(tmp_path, "h100-nvswitch"):
        result = cli("plan", job, "--json")
    assert result.code == 0, result.err
    plan = json.loads(result.out)
    assert plan["nodes"][0]["gpu_indices"] == list(range(8))
    assert plan["nodes"][0]["gpu_models"] == ["H100-80GB"] * 8


def test_memory_and_link_are_the_probes(tmp_path: Path) -> None:
    """81,559 MiB is 80 GB (not 85.5), and the NVSwitch box is graded against the NVSwitch
    floor (460 GB/s for 8 H100s), not PCIe's 20 GB/s."""
    with machine(tmp_path, "h100-nvswitch"):
        node = local_inventory().nodes[0]
        gpus = probe_gpus()
    assert {g.memory_gb for g in node.gpus} == {80.0}
    assert node.gpu_link == "nvswitch"
    floor = intra_node_floor(node, [g.model for g in node.gpus], "nccl")
    assert floor is not None and floor.GBps == 460.0
    assert gpus == list(node.gpus)


def test_nvlink_pairs_and_a_mixed_server(tmp_path: Path) -> None:
    with machine(tmp_path, "a100-nvlink-pairs"):
        pairs = local_inventory().nodes[0]
    with machine(tmp_path, "ambers-a100-a6000"):
        ambers = local_inventory().nodes[0]
    assert pairs.gpu_link == "nvlink" and pairs.models() == {"A100-80GB": 8}
    assert ambers.gpu_link == "pcie"
    assert set(ambers.models()) == {"A100-80GB", "RTX-A6000"}
    assert all(isinstance(g, Gpu) and g.memory_gb in (48.0, 80.0) for g in ambers.gpus)


def test_without_nvidia_smi_the_machine_is_cpu_slots(tmp_path: Path) -> None:
    with machine(tmp_path, "cpu"):
        node = local_inventory().nodes[0]
        assert probe_gpus() == []
    assert not node.gpus and node.gpu_link == "none"
    assert node.slots is not None and node.slots >= 1 and node.slots == node.cpus


def test_gpus_shows_the_models_a_job_names_and_a_job_copying_them_plans(tmp_path: Path) -> None:
    """The field notes' round trip: ``orchestrate gpus`` printed nvidia-smi's ``NVIDIA A100
    80GB PCIe``, which ``gpu_model:`` refuses. It prints the probe's names, the raw one beside."""
    with machine(tmp_path, "ambers-a100-a6000"):
        table = cli("gpus")
        listed = cli("gpus", "--json")
        assert table.code == 0 and listed.code == 0, table.err + listed.err
        gpus = json.loads(listed.out)["gpus"]
        models = {g["model"]: g["name"] for g in gpus}
        assert models == {"A100-80GB": "NVIDIA A100 80GB PCIe", "RTX-A6000": "NVIDIA RTX A6000"}
        rows = [" ".join(line.replace("│", " ").split()) for line in table.out.splitlines()]
        assert "0 A100-80GB NVIDIA A100 80GB PCIe 0.0 / 80.0 GB 0% pass free" in rows
        assert "7 RTX-A6000 NVIDIA RTX A6000 0.0 / 48.0 GB 0% pass free" in rows
        for model, count in (("A100-80GB", 2), ("RTX-A6000", 6)):
            job = tmp_path / f"{model}.yaml"
            job.write_text(f"name: g\nbackend: local\nresources: {{nodes: 1, gpus_per_node: "
                           f"{count}, gpu_model: {model}}}\ncommand: [python, -c, pass]\n")
            result = cli("plan", job, "--json")
            assert result.code == 0, result.err
            assert json.loads(result.out)["nodes"][0]["gpu_models"] == [model] * count
