"""The static tier's judgement: facts as nodes report them, against the plan and inventory.

What a user checks: a node with another torch, a missing interface, GPUs out of PCI order, a
Docker-sized /dev/shm, a capped memlock on InfiniBand or a drifting clock is named, with what
was found, what was expected, and what to do.
"""

from __future__ import annotations

from typing import Any

import pytest

from orchestrate.core.spec.inventory import InventorySpec, resolve_inventory
from orchestrate.doctor.grading import JobShape, PlannedNode, exit_status
from orchestrate.doctor.static_tier import NodeFacts, facts_from_json, judge_static

pytestmark = pytest.mark.unit

GiB = 1 << 30


def shape(nodes: list[dict[str, Any]], backend: str = "nccl", **defaults: Any) -> JobShape:
    inv = resolve_inventory(InventorySpec.model_validate(
        {"name": "lab", "defaults": defaults, "nodes": nodes}))
    planned = tuple(
        PlannedNode(n.name, n, n.capacity, tuple(g.model for g in n.gpus),
                    tuple(g.index for g in n.gpus),
                    n.network.interface if n.network else None)
        for n in inv.nodes
    )
    return JobShape(planned, backend, inv.nodes[0].address, 29500)


def healthy(name: str, **changes: Any) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "versions": {"python": "3.11.7", "torch": "2.6.0+cu124", "cuda": "12.4",
                     "nccl": "2.21.5", "driver": "550.54.15"},
        "interface": {"name": "eno1", "exists": True, "up": True, "speed_mbps": 25000,
                      "routes_to_master": True, "route_dev": "eno1",
                      "available": ["lo", "eno1", "docker0"]},
        "shm_bytes": 64 * GiB,
        "memlock": "unlimited",
        "clock_offset_s": 0.003,
        "gpus": [[i, "A100-80GB", 80] for i in range(4)],
    }
    facts.update(changes)
    return facts


A100 = [{"name": "gpu[1-3]", "gpus": [{"model": "A100-80GB", "memory_gb": 80, "count": 4}]}]
NET = {"network": {"interface": "eno1", "fabric": "ethernet", "gbps": 25}}


def rows_by(rows: list[Any]) -> dict[tuple[str, tuple[str, ...]], Any]:
    return {(r.name, r.nodes): r for r in rows}


def test_healthy_nodes_pass() -> None:
    job = shape(A100, **NET)
    facts = facts_from_json({n: healthy(n) for n in ("gpu1", "gpu2", "gpu3")})
    rows = judge_static(job, facts)
    assert {r.status for r in rows} == {"pass"}, [r for r in rows if r.status != "pass"]
    names = {r.name for r in rows}
    assert names == {"version: python", "version: torch", "version: cuda", "version: nccl",
                     "version: driver", "gpus", "interface", "/dev/shm", "clock"}


def test_one_node_with_another_torch_fails_naming_it() -> None:
    job = shape(A100, **NET)
    facts = {n: healthy(n) for n in ("gpu1", "gpu2", "gpu3")}
    facts["gpu2"]["versions"] = {**facts["gpu2"]["versions"], "torch": "2.5.1+cu124"}
    rows = [r for r in judge_static(job, facts_from_json(facts)) if r.status != "pass"]
    assert len(rows) == 1
    row = rows[0]
    assert (row.name, row.nodes, row.status) == ("version: torch", ("gpu2",), "fail")
    assert row.detail == ("torch differs between nodes (gpu1, gpu3: 2.6.0+cu124; "
                          "gpu2: 2.5.1+cu124)")
    assert row.expected == "identical on every node (2.6.0+cu124)"
    assert exit_status(rows) == 1


def test_missing_interface_fails_on_that_node_only() -> None:
    job = shape(A100, **NET)
    facts = {n: healthy(n) for n in ("gpu1", "gpu2", "gpu3")}
    facts["gpu3"]["interface"] = {"name": "eno1", "exists": False,
                                  "available": ["lo", "ens3"], "route_dev": "ens3"}
    bad = [r for r in judge_static(job, facts_from_json(facts)) if r.status != "pass"]
    assert [(r.name, r.nodes, r.status) for r in bad] == [("interface", ("gpu3",), "fail")]
    assert bad[0].detail == "eno1 does not exist on gpu3 (it has: lo, ens3)"


def test_interface_that_does_not_route_to_the_master() -> None:
    job = shape(A100, **NET)
    facts = {n: healthy(n) for n in ("gpu1", "gpu2", "gpu3")}
    facts["gpu2"]["interface"] = {**facts["gpu2"]["interface"], "routes_to_master": False,
                                  "route_dev": "docker0"}
    row = rows_by(judge_static(job, facts_from_json(facts)))[("interface", ("gpu2",))]
    assert row.status == "fail" and "leaves through docker0, not eno1" in row.detail


def test_link_speed_against_declared_gbps() -> None:
    job = shape(A100, **NET)
    facts = {n: healthy(n) for n in ("gpu1", "gpu2", "gpu3")}
    facts["gpu1"]["interface"] = {**facts["gpu1"]["interface"], "speed_mbps": 10000}
    facts["gpu3"]["interface"] = {**facts["gpu3"]["interface"], "speed_mbps": 1000}
    rows = rows_by(judge_static(job, facts_from_json(facts)))
    assert rows[("interface", ("gpu1",))].status == "warn"
    assert "40% of the inventory's 25 Gb/s" in rows[("interface", ("gpu1",))].detail
    assert rows[("interface", ("gpu3",))].status == "fail"
    assert rows[("interface", ("gpu2",))].status == "pass"


def test_gpus_out_of_pci_order_and_missing() -> None:
    mixed = [{"name": "amber", "gpus": [{"model": "A100-80GB", "memory_gb": 80,
                                         "indices": [0, 1]},
                                        {"model": "RTX-A6000", "memory_gb": 48,
                                         "indices": [2, 3]}]}]
    job = shape(mixed)
    # In PCI bus order the A6000s come first: the inventory's indices are wrong.
    gpus = [
        {"index": 0, "model": "A100-80GB", "memory_gb": 80, "bus_id": "00000000:81:00.0"},
        {"index": 1, "model": "A100-80GB", "memory_gb": 80, "bus_id": "00000000:C1:00.0"},
        {"index": 2, "model": "RTX-A6000", "memory_gb": 48, "bus_id": "00000000:01:00.0"},
        {"index": 3, "model": "RTX-A6000", "memory_gb": 48, "bus_id": "00000000:41:00.0"},
    ]
    facts = facts_from_json({"amber": healthy("amber", gpus=gpus, interface=None)})
    row = rows_by(judge_static(job, facts))[("gpus", ("amber",))]
    assert row.status == "fail"
    assert "index 0 is RTX-A6000, the inventory says A100-80GB (A100-80GB is at 2, 3 in PCI " \
           "bus order" in row.detail
    three = facts_from_json({"amber": healthy("amber", interface=None, gpus=[
        [0, "A100-80GB", 80], [1, "A100-80GB", 80], [2, "RTX-A6000", 48]])})
    row = rows_by(judge_static(job, three))[("gpus", ("amber",))]
    assert row.status == "fail" and "CUDA index 3 is not there (3 GPU(s) seen)" in row.detail


def test_cpu_build_of_torch_on_a_gpu_node() -> None:
    job = shape([{"name": "g", "gpus": [{"model": "A100-80GB", "memory_gb": 80, "count": 1}]}])
    facts = healthy("g", interface=None)
    facts["versions"] = {**facts["versions"], "torch": "2.6.0+cpu", "cuda": None}
    row = rows_by(judge_static(job, facts_from_json({"g": facts})))[("gpus", ("g",))]
    assert row.status == "fail" and "CPU build" in row.detail


def test_docker_shm_and_memlock_on_infiniband() -> None:
    job = shape(A100, network={"interface": "ib0", "fabric": "infiniband", "gbps": 200,
                               "hca": "mlx5_0"})
    facts = {n: healthy(n, interface={"name": "ib0", "exists": True, "up": True,
                                      "speed_mbps": 200000, "routes_to_master": True})
             for n in ("gpu1", "gpu2", "gpu3")}
    facts["gpu1"]["shm_bytes"] = 64 << 20          # Docker's default
    facts["gpu2"]["shm_bytes"] = 512 << 20
    facts["gpu3"]["memlock"] = 8192 * 1024         # nccl-tests #206
    rows = rows_by(judge_static(job, facts_from_json(facts)))
    assert rows[("/dev/shm", ("gpu1",))].status == "fail"
    assert "--shm-size" in rows[("/dev/shm", ("gpu1",))].hint
    assert rows[("/dev/shm", ("gpu2",))].status == "warn"
    assert rows[("memlock", ("gpu3",))].status == "fail"
    assert rows[("memlock", ("gpu3",))].measured == "8192 KiB"
    assert rows[("memlock", ("gpu1",))].status == "pass"


def test_clock_offset_and_unreachable_node() -> None:
    job = shape(A100, **NET)
    facts = {n: healthy(n) for n in ("gpu1", "gpu2")}
    facts["gpu1"]["clock_offset_s"] = 2.5
    facts["gpu2"]["clock_offset_s"] = -75.0
    facts["gpu3"] = {"versions": {}, "error": "ssh: unreachable: 10.0.0.3:22"}
    rows = rows_by(judge_static(job, facts_from_json(facts)))
    assert rows[("clock", ("gpu1",))].status == "warn"
    assert rows[("clock", ("gpu2",))].status == "fail"
    assert rows[("facts", ("gpu3",))].status == "fail"
    assert "unreachable" in rows[("facts", ("gpu3",))].detail
    assert rows[("version: torch", ("gpu1", "gpu2"))].status == "pass"


def test_cpu_nodes_skip_gpu_versions() -> None:
    job = shape([{"name": "c[1-2]", "slots": 2}], backend="gloo")
    facts = facts_from_json({n: healthy(n, gpus=None, interface=None, versions={
        "python": "3.10.13", "torch": "2.6.0+cpu", "cuda": None, "nccl": None,
        "driver": None}) for n in ("c1", "c2")})
    rows = judge_static(job, facts)
    assert {r.name for r in rows} == {"version: python", "version: torch", "/dev/shm", "clock",
                                      "interface"}
    assert NodeFacts.from_json({"versions": {}}).memlock is None
