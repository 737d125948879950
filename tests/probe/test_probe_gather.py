"""The gatherer on a host: real processes, the stand-in nvidia-smi, fake and real sysfs."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrate.hostside import hostfacts
from orchestrate.probe.facts import parse_facts
from orchestrate.probe.gathering import facts_argv
from tests.support.probemachine import FIXTURES, machine
from tests.support.python38 import python38 as _python38

pytestmark = pytest.mark.process


PY38 = _python38()


def test_gpus_come_back_as_nvidia_smi_printed_them(tmp_path: Path) -> None:
    with machine(tmp_path, "ambers-a100-a6000"):
        facts = hostfacts.gather(torch=False)
    smi = facts["nvidia_smi"]
    assert smi["status"] == "ok" and smi["error"] is None
    assert smi["fields"] == list(hostfacts.GPU_FIELDS)
    lines = smi["query"].splitlines()
    assert lines[0].startswith("index, pci.bus_id, uuid, name, memory.total [MiB]")
    assert "NVIDIA RTX A6000, 49140" in lines[3]
    assert smi["topo"] == (FIXTURES / "ambers-a100-a6000" / "topo.txt").read_text()
    assert facts["errors"] == []


def test_numa_nodes_come_from_sysfs_and_their_gpus_from_the_topology(tmp_path: Path) -> None:
    """sysfs lists every NUMA node with its CPUs (a node without GPUs too); the matrix's NUMA
    Affinity column says which node each GPU hangs off."""
    with machine(tmp_path, "ambers-a100-a6000") as root:
        for node, cpus in (("0", "0-55,112-167"), ("1", "56-111,168-223"), ("2", "224-231")):
            folder = root / "devices" / "system" / "node" / f"node{node}"
            folder.mkdir(parents=True)
            (folder / "cpulist").write_text(cpus + "\n")
        (root / "devices" / "system" / "node" / "online").write_text("0-2\n")
        facts = hostfacts.gather(torch=False)
    assert facts["numa"] == {"0": "0-55,112-167", "1": "56-111,168-223", "2": "224-231"}
    parsed = parse_facts(facts)
    assert [(n.node, n.cpus, n.gpus) for n in parsed.numa] == [
        (0, "0-55,112-167", (0, 1, 2, 3)), (1, "56-111,168-223", (4, 5, 6, 7)),
        (2, "224-231", ())]


def test_nics_and_hcas_from_a_fake_sysfs(tmp_path: Path) -> None:
    with machine(tmp_path, "h100-nvswitch"):
        facts = hostfacts.gather(torch=False)
    nics = {n["name"]: n for n in facts["net"]["interfaces"]}
    assert nics["eno1"]["speed_mbps"] == 1000 and nics["eno1"]["physical"]
    assert nics["ib0"]["type"] == 32 and nics["ib0"]["mtu"] == 4092
    assert nics["docker0"]["bridge"] and not nics["docker0"]["physical"]
    assert not nics["veth3f2a1c9"]["physical"]
    assert nics["ib0"]["speed_mbps"] is None  # no speed file, as for IPoIB links here
    hcas = {h["name"]: h for h in facts["net"]["infiniband"]}
    assert hcas["mlx5_0"]["netdevs"] == ["ib0"]
    assert hcas["mlx5_0"]["ports"] == [
        {"port": 1, "state": "4: ACTIVE", "rate": "400 Gb/sec (4X NDR)",
         "link_layer": "InfiniBand"}
    ]
    assert hcas["mlx5_1"]["ports"][0]["state"] == "1: DOWN"


def test_a_host_without_nvidia_smi_is_a_cpu_node_not_an_error(tmp_path: Path) -> None:
    with machine(tmp_path, "cpu"):
        facts = hostfacts.gather(torch=False)
    assert facts["nvidia_smi"]["status"] == "missing"
    assert facts["nvidia_smi"]["error"] == "nvidia-smi not found on PATH"
    assert facts["errors"] == []
    assert facts["cpus"]["usable"] == len(os.sched_getaffinity(0))
    assert facts["memory_kib"] > 0


def test_a_failing_nvidia_smi_is_reported_with_its_message(tmp_path: Path) -> None:
    with machine(tmp_path, "driver-mismatch"):
        facts = hostfacts.gather(torch=False)
    smi = facts["nvidia_smi"]
    assert smi["status"] == "failed"
    assert smi["error"] == ("Failed to initialize NVML: Driver/library version mismatch\n"
                            "NVML library version: 570.124 (exit status 18)")
    assert facts["errors"] == ["nvidia-smi failed: " + smi["error"]]
    assert facts["net"]["interfaces"]  # the rest was still gathered


def test_an_old_driver_gets_the_fields_it_knows(tmp_path: Path) -> None:
    with machine(tmp_path, "h100-nvswitch", FAKE_NVSMI_UNKNOWN="compute_cap"):
        facts = hostfacts.gather(torch=False)
    smi = facts["nvidia_smi"]
    assert smi["status"] == "ok"
    assert smi["fields"] == list(hostfacts.GPU_FIELDS_OLD)
    assert "compute_cap" not in smi["query"].splitlines()[0]


@pytest.mark.timing
def test_a_hung_nvidia_smi_costs_its_timeout_and_no_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hostfacts, "NVIDIA_SMI_TIMEOUT_S", 0.5)
    with machine(tmp_path, "h100-nvswitch", FAKE_NVSMI_SLEEP="30"):
        started = time.monotonic()
        facts = hostfacts.gather(torch=False)
        took = time.monotonic() - started
    assert facts["nvidia_smi"]["status"] == "failed"
    assert "did not answer within" in facts["nvidia_smi"]["error"]
    assert took < 5


def test_routes_to_loopback_peers_name_the_interface(tmp_path: Path) -> None:
    facts = hostfacts.gather(["127.0.0.1", "localhost", "no-such-host.invalid"], torch=False)
    assert facts["routes"]["127.0.0.1"] == {"interface": "lo", "ip": "127.0.0.1"}
    assert facts["routes"]["localhost"]["interface"] == "lo"
    assert "cannot resolve no-such-host.invalid" in facts["routes"]["no-such-host.invalid"][
        "error"]
    assert any("no-such-host.invalid" in e for e in facts["errors"])


def test_limits_shm_python_and_clock() -> None:
    before = time.time()
    facts = hostfacts.gather(torch=False)
    assert before - 1 <= facts["time"] <= time.time()
    assert facts["python"] == {"executable": sys.executable, "version": sys.version.split()[0]}
    assert facts["shm_bytes"] and facts["shm_bytes"] > 0
    assert set(facts["memlock"]) == {"soft", "hard"}
    assert facts["torch"] is None
    json.dumps(facts)  # all of it travels as JSON


def test_torch_is_found_without_importing_it() -> None:
    quick = hostfacts.gather(torch=True)["torch"]
    assert quick["version"] == importlib.metadata.version("torch")
    assert quick["imported"] is False and set(quick) == {"version", "cuda", "nccl", "imported"}
    with_bad_python = hostfacts.gather(torch=True, python="/nonexistent/python")["torch"]
    assert with_bad_python == {"error": "could not start the python interpreter to look for torch"}


@pytest.mark.torch
def test_importing_torch_proves_it_loads() -> None:
    import torch

    loaded = hostfacts.gather(torch=True, import_torch=True)["torch"]
    assert (loaded["version"], loaded["imported"]) == (torch.__version__, True)


@pytest.mark.skipif(PY38 is None, reason="no Python 3.8 on this machine")
def test_runs_as_shipped_on_python_3_8_without_site(tmp_path: Path) -> None:
    """What the SSH transport does: the shipped gatherer (hostfacts and the modules it carries,
    :data:`orchestrate.probe.gathering.GATHERER`), ``python -S``, on Python 3.8."""
    with machine(tmp_path, "a100-nvlink-pairs"):
        proc = subprocess.run(facts_argv(str(PY38), ["127.0.0.1"], bound_s=60),
                              capture_output=True, text=True, timeout=60, check=False,
                              env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    assert facts["python"]["version"].startswith("3.8.")
    assert facts["nvidia_smi"]["status"] == "ok"
    assert "NVIDIA A100 80GB PCIe" in facts["nvidia_smi"]["query"]
    assert facts["routes"]["127.0.0.1"]["interface"] == "lo"
    assert facts["torch"] == {"error": "ModuleNotFoundError: No module named 'torch'"}
