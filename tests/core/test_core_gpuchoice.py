"""Placement by topology: which free GPUs of a node a job gets, and the reason `plan` shows.

The server is the field notes' (issue #35): 8 GPUs on two sockets, GPUs 0-3 on NUMA node 0,
4-7 on node 1, every pair ``SYS`` in ``nvidia-smi topo -m``. Its inventory entry is the one
``inventory probe`` writes from its captured outputs (tests/probe/fixtures/ambers-a100-a6000:
the GPU query and the topology matrix, parsed as the probe parses them), so the NUMA nodes here
are what the probe read, not typed by hand. What a user checks: the GPUs in CUDA_VISIBLE_DEVICES,
each rank's CPU list, OMP_NUM_THREADS, and the note that says why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchestrate.core.plan import rankenv
from orchestrate.core.plan.gpuchoice import choose
from orchestrate.core.plan.plan import Occupancy, Plan
from orchestrate.core.spec.cpulist import cpu_set
from orchestrate.core.spec.inventory import Gpu, Inventory
from orchestrate.hostside import cpubind
from orchestrate.probe.facts import parse_facts
from orchestrate.probe.inventoryfile import probed_fields
from tests.support.plans import A6000, gpu_node, inventory, job, plan

pytestmark = pytest.mark.unit

CAPTURED = Path(__file__).resolve().parents[1] / "probe" / "fixtures" / "ambers-a100-a6000"
NODE0, NODE1 = "0-55,112-167", "56-111,168-223"


def notes_server() -> Inventory:
    """The notes' server as `inventory probe` writes it from its captured nvidia-smi outputs."""
    facts = parse_facts({"nvidia_smi": {
        "status": "ok", "query": (CAPTURED / "query.csv").read_text(),
        "topo": (CAPTURED / "topo.txt").read_text()}, "cpus": {"usable": 224}})
    return inventory({"name": "ambers", **probed_fields(facts)})


def placed(gpus: int, held: tuple[int, ...] = (), **resources: Any) -> Plan:
    spec = job(resources={"gpus_per_node": gpus, "gpu_model": "RTX-A6000", **resources})
    return plan(spec, notes_server(),
                occupancy=Occupancy(busy_gpus={"ambers": frozenset(held)}))


def binding(p: Plan) -> list[str]:
    return p.nodes[0].env[rankenv.CPU_BIND_VAR].split(";")


def test_the_replayed_server_has_two_numa_nodes_of_four_gpus() -> None:
    node = notes_server().nodes[0]
    assert [(n.node, n.cpus, n.gpus) for n in node.numa] == [
        (0, NODE0, (0, 1, 2, 3)), (1, NODE1, (4, 5, 6, 7))]
    assert node.islands == ()  # every pair SYS: no switch, no NVLink


@pytest.mark.parametrize(("gpus", "held", "expected", "numa"), [
    (2, (), (2, 3), 0),             # the A6000s on node 0 fill it exactly
    (4, (), (4, 5, 6, 7), 1),       # only node 1 has four
    (2, (2,), (4, 5), 1),           # 3 alone on node 0: not 3 and 4 across the socket link
    (2, (2, 5), (4, 6), 1),         # first free would be 3,4
    (2, (4,), (2, 3), 0),           # best fit: node 1's three stay together for a bigger job
    (4, (3,), (4, 5, 6, 7), 1),
])
def test_jobs_land_on_one_numa_node_when_one_has_room(
        gpus: int, held: tuple[int, ...], expected: tuple[int, ...], numa: int) -> None:
    p = placed(gpus, held)
    assert p.nodes[0].gpu_indices == expected
    cpus = NODE0 if numa == 0 else NODE1
    assert binding(p) == [cpus] * gpus
    assert p.nodes[0].env["OMP_NUM_THREADS"] == str(112 // gpus)
    assert f"placement: ambers: GPUs {','.join(map(str, expected))} on NUMA node {numa} " \
        f"(CPUs {cpus})" in p.notes


def test_a_job_bigger_than_any_free_numa_node_spans_as_few_as_it_can() -> None:
    p = placed(4, held=(4,))  # 2,3 free on node 0, 5,6,7 on node 1
    assert p.nodes[0].gpu_indices == (2, 5, 6, 7)
    assert binding(p) == [NODE0, NODE1, NODE1, NODE1]
    assert p.nodes[0].env["OMP_NUM_THREADS"] == str(112 // 3)  # node 1's CPUs over its 3 ranks
    assert "placement: ambers: GPUs 2,5,6,7 across NUMA nodes 0, 1: no NUMA node has 4 free " \
        "GPUs" in p.notes
    p = placed(4, held=(4, 5))  # the only four free
    assert p.nodes[0].gpu_indices == (2, 3, 6, 7)
    assert "placement: ambers: GPUs 2,3,6,7 across NUMA nodes 0, 1" in p.notes


def test_spread_deals_the_gpus_across_numa_nodes() -> None:
    p = placed(2, placement="spread")
    assert p.nodes[0].gpu_indices == (2, 4)
    assert binding(p) == [NODE0, NODE1]
    assert any("spread across NUMA nodes 0, 1" in n for n in p.notes)


def test_any_keeps_the_first_free_gpus() -> None:
    p = placed(2, held=(2,), placement="any")
    assert p.nodes[0].gpu_indices == (3, 4)
    assert binding(p) == [NODE0, NODE1]  # bound all the same, each rank to its own GPU's node


def test_the_users_thread_count_wins() -> None:
    spec = job(resources={"gpus_per_node": 2, "gpu_model": "RTX-A6000"},
               env={"OMP_NUM_THREADS": 3})
    assert plan(spec, notes_server()).nodes[0].env["OMP_NUM_THREADS"] == "3"
    spec = job(resources={"gpus_per_node": 2, "gpu_model": "RTX-A6000"},
               distributed={"omp_num_threads": 5})
    assert plan(spec, notes_server()).nodes[0].env["OMP_NUM_THREADS"] == "5"


def test_without_numa_nodes_nothing_changes() -> None:
    inv = inventory(gpu_node("g", 4, cpus=32))
    p = plan(job(resources={"gpus_per_node": 2}), inv,
             occupancy=Occupancy(busy_gpus={"g": frozenset({0})}))
    assert p.nodes[0].gpu_indices == (1, 2)
    assert rankenv.CPU_BIND_VAR not in p.nodes[0].env
    assert p.nodes[0].env["OMP_NUM_THREADS"] == "16"
    assert not [n for n in p.notes if n.startswith("placement:")]


def test_slurm_leaves_the_gpus_to_slurm_and_each_rank_finds_its_own() -> None:
    spec = job(backend="slurm", resources={"gpus_per_node": 2, "gpu_model": "RTX-A6000"})
    p = plan(spec, notes_server())
    assert p.nodes[0].env[rankenv.CPU_BIND_VAR] == "slurm"
    assert not [n for n in p.notes if n.startswith("placement:")]  # no claim Slurm may belie


def slurm_node(tmp: Path, minors: dict[int, tuple[str, str]]) -> dict[str, str]:
    """A node's /proc/driver/nvidia and sysfs as the driver and kernel lay them out: each
    minor's bus id and that device's local_cpulist; the roots to point cpubind at."""
    for minor, (bus, cpus) in minors.items():
        info = tmp / "proc" / "driver" / "nvidia" / "gpus" / bus
        info.mkdir(parents=True)
        (info / "information").write_text(
            f"Model: \t\t NVIDIA RTX A6000\nIRQ:   \t\t 150\nBus Location: \t {bus}\n"
            f"Device Minor: \t {minor}\n")
        device = tmp / "sys" / "bus" / "pci" / "devices" / bus
        device.mkdir(parents=True)
        (device / "local_cpulist").write_text(cpus + "\n")
    return {"ORCHESTRATE_PROC_ROOT": str(tmp / "proc"), "ORCHESTRATE_SYSFS_ROOT": str(tmp / "sys")}


def test_under_slurm_a_rank_reads_its_gpus_cpus_from_the_driver_and_sysfs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm gave the job GPUs with minors 5 and 2 (SLURM_JOB_GPUS, any order): in PCI bus
    order 2 (bus 0000:25) is cuda:0 and 5 (bus 0000:c1) cuda:1."""
    roots = slurm_node(tmp_path, {2: ("0000:25:00.0", "0-55,112-167"),
                                  5: ("0000:c1:00.0", "56-111,168-223"),
                                  6: ("0000:e1:00.0", "56-111,168-223")})
    for key, value in roots.items():
        monkeypatch.setenv(key, value)
    env = {cpubind.CPU_BIND_VAR: "slurm", "SLURM_JOB_GPUS": "5,2"}
    assert cpubind.wanted({**env, "LOCAL_RANK": "0"}) == cpu_set("0-55,112-167")
    assert cpubind.wanted({**env, "LOCAL_RANK": "1"}) == cpu_set("56-111,168-223")
    assert cpubind.wanted({**env, "LOCAL_RANK": "2"}) is None  # no third GPU: unbound
    assert cpubind.wanted({cpubind.CPU_BIND_VAR: "slurm", "LOCAL_RANK": "0"}) is None
    monkeypatch.setenv("ORCHESTRATE_PROC_ROOT", str(tmp_path / "no-driver"))
    assert cpubind.wanted({**env, "LOCAL_RANK": "0"}) is None  # no driver: unbound, no error


ISLANDS = inventory({**gpu_node("n", 8, A6000), "numa": [
    {"node": 0, "cpus": "0-7", "gpus": [0, 1, 2, 3]}, {"node": 1, "cpus": "8-15",
                                                      "gpus": [4, 5, 6, 7]}],
    "gpu_islands": [{"gpus": [0, 1], "via": "nvlink"}, {"gpus": [2, 3], "via": "nvlink"},
                    {"gpus": [4, 5, 6, 7], "via": "pcie-switch"}]}).nodes[0]


def gpus(*indices: int) -> list[Gpu]:
    return [g for g in ISLANDS.gpus if g.index in indices]


def test_within_a_numa_node_an_island_that_holds_the_job_wins() -> None:
    picked = choose(ISLANDS, gpus(1, 2, 3, 4, 5, 6, 7), 2)
    assert [g.index for g in picked.gpus] == [2, 3]
    assert picked.why == "GPUs 2,3 on NUMA node 0 (CPUs 0-7), joined by NVLink"


def test_a_numa_node_with_an_island_for_the_job_beats_a_tighter_one_without() -> None:
    picked = choose(ISLANDS, gpus(1, 3, 5, 6, 7), 2)
    assert [g.index for g in picked.gpus] == [5, 6]
    assert picked.why.endswith("under one PCIe switch")


def test_islands_are_kept_whole_when_the_job_needs_more_than_one() -> None:
    picked = choose(ISLANDS, gpus(0, 1, 2, 3, 4), 3)
    assert [g.index for g in picked.gpus] == [0, 1, 2]


def test_the_cpu_list_reads_the_same_on_both_sides() -> None:
    assert cpu_set("0-2,8,10-11") == cpubind.cpu_set("0-2,8,10-11") == {0, 1, 2, 8, 10, 11}
    assert rankenv.CPU_BIND_VAR == cpubind.CPU_BIND_VAR
