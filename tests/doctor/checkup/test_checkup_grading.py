"""Grading with realistic numbers (the public figures of the reference notes, §1.2).

What a user checks: a healthy measurement passes, a weak one warns, a broken one fails; a
slow node is named as the node, a slow link as the link, and a healthy pair is never blamed.
"""

from __future__ import annotations

from typing import Any

import pytest

from orchestrate.core.plan.plan import make_plan
from orchestrate.core.spec.inventory import Inventory, InventorySpec, resolve_inventory
from orchestrate.core.spec.job import JobSpec
from orchestrate.doctor import floors
from orchestrate.doctor.bandwidth import judge_bandwidth
from orchestrate.doctor.checkup.result import (
    CheckupFailure,
    CheckupResult,
    PairMatrix,
    SizeTiming,
    Sweep,
)
from orchestrate.doctor.grading import (
    ConnectAttempt,
    JobShape,
    Listening,
    PlannedNode,
    culprits,
    document,
    exit_status,
    judge_checkup,
    judge_connect,
    shape_of,
    verdict,
)

pytestmark = pytest.mark.unit

GiB = 1 << 30


def inventory(nodes: list[dict[str, Any]], **defaults: Any) -> Inventory:
    return resolve_inventory(InventorySpec.model_validate(
        {"name": "lab", "defaults": defaults, "nodes": nodes}))


def shape(inv: Inventory, backend: str, nproc: dict[str, int] | None = None) -> JobShape:
    planned = []
    for node in inv.nodes:
        count = (nproc or {}).get(node.name, node.capacity)
        planned.append(PlannedNode(
            name=node.name, node=node, nproc=count,
            gpu_models=tuple(g.model for g in node.gpus[:count]),
            gpu_indices=tuple(g.index for g in node.gpus[:count]),
        ))
    return JobShape(tuple(planned), backend, inv.nodes[0].address, 29500)


def timing(busbw_GBps: float, ranks: int, nbytes: int = GiB) -> SizeTiming:
    """A size whose busbw is ``busbw_GBps`` over ``ranks`` ranks."""
    algbw = busbw_GBps / (2 * (ranks - 1) / ranks)
    seconds = nbytes / (algbw * 1e9)
    return SizeTiming(nbytes, 10, seconds, seconds * 1.01, ranks)


def sweep(busbw_GBps: float, ranks: int, nodes: int) -> Sweep:
    return Sweep(ranks, nodes, (timing(busbw_GBps / 20, ranks, 1 << 20),
                                timing(busbw_GBps, ranks)))


def result(nodes: tuple[str, ...], backend: str = "nccl", **figures: Any) -> CheckupResult:
    return CheckupResult(("smoke", "bandwidth"), backend, 8, nodes, (), 1.0, **figures)


# -- inside a node ------------------------------------------------------------------------------

A100_BOX = [{"name": "dgx1", "gpus": [{"model": "A100-80GB", "memory_gb": 80, "count": 8}],
             "gpu_link": "nvswitch"}]


@pytest.mark.parametrize(("busbw", "status"), [
    (180.0, "pass"),   # a healthy-ish DGX A100 (~200-235 GB/s public)
    (114.0, "pass"),   # exactly 50 % of Azure's 228 GB/s floor
    (113.0, "warn"),
    (45.7, "warn"),    # just above 20 %
    (45.5, "fail"),
    (20.0, "fail"),    # nccl-tests #178: the ring fell to PCIe
])
def test_a100_nvswitch_node_against_the_azure_floor(busbw: float, status: str) -> None:
    inv = inventory(A100_BOX)
    rows, section = judge_bandwidth(result(("dgx1",), world=sweep(busbw, 8, 1)),
                                    shape(inv, "nccl"))
    (row,) = rows
    assert (row.name, row.nodes, row.status) == ("all_reduce", ("dgx1",), status)
    assert row.expected is not None and row.expected.startswith(">= 228 GB/s")
    assert row.measured == f"{busbw:.3g} GB/s"
    assert section["all_reduce"]["expected"]["floor_GBps"] == 228.0
    assert section["all_reduce"]["expected"]["warn_below_GBps"] == 114.0


def test_h100_floor_depends_on_nvls() -> None:
    h100 = inventory([{"name": "h", "gpus": [{"model": "H100-80GB", "memory_gb": 80,
                                              "count": 8}], "gpu_link": "nvswitch"}])
    node = h100.nodes[0]
    eight = floors.intra_node_floor(node, ["H100-80GB"] * 8, "nccl")
    assert eight is not None and eight.GBps == 460.0
    four = floors.intra_node_floor(node, ["H100-80GB"] * 4, "nccl")
    assert four is not None and four.GBps == 363.0


def test_intra_node_floors_by_link() -> None:
    pairs = inventory([{"name": "p", "gpus": [{"model": "A100-40GB", "memory_gb": 40,
                                               "count": 8}], "gpu_link": "nvlink"}]).nodes[0]
    two = floors.intra_node_floor(pairs, ["A100-40GB"] * 2, "nccl")
    eight = floors.intra_node_floor(pairs, ["A100-40GB"] * 8, "nccl")
    assert two is not None and two.GBps == 208.0
    assert eight is not None and eight.GBps == 20.0, "the ring crosses PCIe"
    pcie = inventory([{"name": "w", "gpus": [{"model": "RTX-A6000", "memory_gb": 48,
                                              "count": 4}], "gpu_link": "pcie"}]).nodes[0]
    floor = floors.intra_node_floor(pcie, ["RTX-A6000"] * 4, "nccl")
    assert floor is not None and floor.GBps == 20.0
    cpu = inventory([{"name": "c", "slots": 4}]).nodes[0]
    assert floors.intra_node_floor(cpu, [], "gloo") is None
    odd = inventory([{"name": "o", "gpus": [{"model": "L40S", "memory_gb": 48, "count": 2}],
                      "gpu_link": "nvswitch"}]).nodes[0]
    assert floors.intra_node_floor(odd, ["L40S"] * 2, "nccl") is None


def test_gloo_on_cpus_is_reported_not_graded() -> None:
    inv = inventory([{"name": "c", "slots": 2}])
    rows, section = judge_bandwidth(result(("c",), backend="gloo", world=sweep(0.8, 2, 1)),
                                    shape(inv, "gloo"))
    (row,) = rows
    assert row.status == "pass" and "not graded: gloo reduces on the CPUs" in row.detail
    assert section["all_reduce"]["expected"] is None


# -- between nodes: all ranks -------------------------------------------------------------------


def test_two_nodes_of_8_h100_on_ndr_pass() -> None:
    """2x8 H100 over 8x NDR-400 per node: 445-456 GB/s busbw @1 GiB (SkyPilot docs)."""
    hcas = ",".join(f"mlx5_{i}" for i in range(8))
    inv = inventory(
        [{"name": "gpu[1-2]", "gpus": [{"model": "H100-80GB", "memory_gb": 80, "count": 8}],
          "gpu_link": "nvswitch"}],
        network={"fabric": "infiniband", "gbps": 400, "hca": hcas},
    )
    rows, section = judge_bandwidth(result(("gpu1", "gpu2"), world=sweep(445.0, 16, 2)),
                                    shape(inv, "nccl"))
    (row,) = rows
    assert row.name == "all_reduce across nodes" and row.status == "pass"
    # 445 x (2-1)/(16-1) = 29.7 GB/s per rank on the wire, of 50 x 0.8 = 40.
    assert row.measured == "29.7 GB/s"
    assert row.expected is not None and row.expected.startswith(">= 40 GB/s")
    assert section["all_reduce"]["expected"]["floor_GBps"] == pytest.approx(40 * 15)


def test_100gbe_tcp_with_8_gpus_per_node_warns_with_the_tcp_hint() -> None:
    """4x8 V100 over 100 GbE TCP: best 4-6 GB/s busbw, 'less than half' (NCCL #450)."""
    inv = inventory(
        [{"name": "v[1-4]", "gpus": [{"model": "V100-32GB", "memory_gb": 32, "count": 8}]}],
        network={"fabric": "ethernet", "gbps": 100},
    )
    rows, _ = judge_bandwidth(result(("v1", "v2", "v3", "v4"), world=sweep(5.0, 32, 4)),
                              shape(inv, "nccl"))
    (row,) = rows
    assert row.status == "warn", row
    assert "NCCL_SOCKET_NTHREADS" in row.hint


# -- between nodes: pairs -----------------------------------------------------------------------


def matrix(names: tuple[str, ...], slow: dict[tuple[str, str], float],
           healthy: float) -> PairMatrix:
    rows = []
    for a in names:
        rows.append(tuple(None if a == b else slow.get((a, b), slow.get((b, a), healthy))
                          for b in names))
    return PairMatrix(names, 16 << 20, tuple(rows))


GBE25 = {"network": {"interface": "eno1", "fabric": "ethernet", "gbps": 25}}


def test_25gbe_node_at_04_GBps_fails_and_is_named() -> None:
    inv = inventory([{"name": "n[1-3]", "slots": 1}], **GBE25)
    pairs = matrix(("n1", "n2", "n3"), {("n3", "n1"): 0.4, ("n3", "n2"): 0.4}, 2.8)
    rows, section = judge_bandwidth(result(("n1", "n2", "n3"), backend="gloo", pairs=pairs),
                                    shape(inv, "gloo"))
    by_name = {r.name: r for r in rows}
    assert set(by_name) == {"node n3", "node pairs"}
    node = by_name["node n3"]
    assert node.status == "fail" and node.nodes == ("n3",)
    assert node.measured == "0.4 GB/s"
    assert node.expected is not None and node.expected.startswith(">= 2.5 GB/s")
    assert "every pair with n3 is slow (2 of 2)" in node.detail
    healthy = by_name["node pairs"]
    assert healthy.status == "pass" and "1 of 3 node pair(s) healthy" in healthy.detail
    assert section["pairs"]["blamed_nodes"] == ["n3"] and section["pairs"]["blamed_links"] == []
    assert verdict(rows) == "fail" and exit_status(rows) == 1


def test_one_slow_direction_names_the_node() -> None:
    """tc shapes a host's egress: only what it sends is slow."""
    inv = inventory([{"name": "n[1-3]", "slots": 1}], **GBE25)
    names = ("n1", "n2", "n3")
    rows_ = [[None, 2.8, 2.8], [2.8, None, 2.8], [0.1, 0.1, None]]
    pairs = PairMatrix(names, 16 << 20, tuple(tuple(r) for r in rows_))
    rows, _ = judge_bandwidth(result(names, backend="gloo", pairs=pairs), shape(inv, "gloo"))
    assert [r.name for r in rows if r.status != "pass"] == ["node n3"]
    assert "n3 sends at 0.1 GB/s, receives at 2.8 GB/s" in rows[0].detail
    assert "n3->n1 0.1 GB/s, n1->n3 2.8 GB/s" in rows[0].detail


def test_one_slow_link_among_healthy_ones() -> None:
    inv = inventory([{"name": "n[1-4]", "slots": 1}], **GBE25)
    names = ("n1", "n2", "n3", "n4")
    pairs = matrix(names, {("n2", "n3"): 0.4}, 2.8)
    rows, section = judge_bandwidth(result(names, backend="gloo", pairs=pairs),
                                    shape(inv, "gloo"))
    bad = [r for r in rows if r.status != "pass"]
    assert [(r.name, r.nodes, r.status) for r in bad] == [
        ("link n2 <-> n3", ("n2", "n3"), "fail")]
    assert section["pairs"]["blamed_nodes"] == []
    assert "5 of 6 node pair(s) healthy" in rows[-1].detail


def test_two_nodes_cannot_tell_which_end() -> None:
    inv = inventory([{"name": "n[1-2]", "slots": 1}], **GBE25)
    rows, _ = judge_bandwidth(result(("n1", "n2"), backend="gloo",
                                     pairs=matrix(("n1", "n2"), {}, 0.4)),
                              shape(inv, "gloo"))
    (row,) = rows
    assert row.name == "link n1 <-> n2" and row.status == "fail"
    assert "cannot tell which end" in row.detail


def test_without_declared_gbps_only_outliers_warn() -> None:
    inv = inventory([{"name": "n[1-3]", "slots": 1}])
    names = ("n1", "n2", "n3")
    rows, _ = judge_bandwidth(
        result(names, backend="gloo", pairs=matrix(names, {("n1", "n3"): 0.9,
                                                           ("n2", "n3"): 0.1}, 1.2)),
        shape(inv, "gloo"))
    assert [(r.name, r.status) for r in rows] == [("link n2 <-> n3", "warn"),
                                                   ("node pairs", "pass")]
    assert rows[0].expected == "within 4x of the best pair (1.2 GB/s)"


def test_culprits() -> None:
    nodes = ["a", "b", "c", "d"]
    assert culprits(nodes, []) == ([], [])
    assert culprits(nodes, [("d", "a"), ("b", "d"), ("c", "d")]) == (["d"], [])
    assert culprits(nodes, [("c", "b")]) == ([], [("b", "c")])
    assert culprits(nodes, [("a", "d"), ("b", "d"), ("c", "d"), ("a", "b")]) == (
        ["d"], [("a", "b")])
    everything = [(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:]]
    assert culprits(nodes, everything) == ([], everything), "a fabric problem, not a node"
    assert culprits(["a", "b"], [("b", "a")]) == ([], [("a", "b")])


# -- smoke ----------------------------------------------------------------------------------------


def test_smoke_rows() -> None:
    inv = inventory([{"name": "n[1-2]", "slots": 2}])
    job = shape(inv, "gloo")
    assert [r.status for r in judge_checkup(None, job)] == ["fail"]
    ok = CheckupResult(("smoke",), "gloo", 4, ("n1", "n2"), (), 0.5,
                       steps_s={"join": 0.2, "init": 0.1, "all_reduce": 0.01})
    (row,) = judge_checkup(ok, job)
    assert row.status == "pass" and row.nodes == ("n1", "n2")
    assert row.measured == "join 0.20 s, init 0.10 s, all_reduce 0.01 s"
    failed = CheckupResult(("smoke",), "gloo", 4, ("n1", "n2"), (), 5.0, failure=CheckupFailure(
        "smoke", "join", "rank 3 (node n2) never joined: ...", (3,), ("n2",),
        {3: "never joined"}))
    (row,) = judge_checkup(failed, job)
    assert (row.status, row.name, row.nodes) == ("fail", "join", ("n2",))
    assert "MASTER_ADDR:MASTER_PORT" in row.hint


def test_document_shape() -> None:
    inv = inventory([{"name": "n[1-3]", "slots": 1}], **GBE25)
    pairs = matrix(("n1", "n2", "n3"), {("n3", "n1"): 0.4, ("n3", "n2"): 0.4}, 2.8)
    rows, section = judge_bandwidth(result(("n1", "n2", "n3"), backend="gloo", pairs=pairs),
                                    shape(inv, "gloo"))
    doc = document(rows, section)
    assert doc["verdict"] == "fail"
    assert set(doc["checks"][0]) == {"tier", "name", "nodes", "status", "detail", "measured",
                                     "expected", "hint"}
    assert doc["bandwidth"]["pairs"]["GBps"][2][0] == 0.4
    assert doc["bandwidth"]["pairs"]["expected"][0][1]["floor_GBps"] == 2.5
    assert document([])["verdict"] == "pass"


# -- connect --------------------------------------------------------------------------------------


def test_firewalled_node_is_named_for_the_ephemeral_ports() -> None:
    inv = inventory([{"name": "n[1-3]", "slots": 1}])
    job = shape(inv, "gloo")
    attempts = [ConnectAttempt(n, "n1", 29500, "master", "ok", 0.001) for n in ("n1", "n2", "n3")]
    for a in ("n1", "n2", "n3"):
        for b in ("n1", "n2", "n3"):
            if a != b:
                outcome = "timeout" if b == "n3" else "ok"
                attempts.append(ConnectAttempt(a, b, 41000, "pair", outcome, 3.0))
    rows = judge_connect(job, [], attempts)
    assert [(r.name, r.status) for r in rows] == [
        ("master port", "pass"), ("node n3", "fail"), ("node-to-node ports", "pass")]
    assert rows[1].detail.startswith("no other node can connect to n3 on ephemeral ports")
    assert "incoming" in rows[1].hint


def test_master_port_problems() -> None:
    inv = inventory([{"name": "n[1-2]", "slots": 1}])
    job = shape(inv, "gloo")
    rows = judge_connect(job, [Listening("n1", 29500, "master", error="address in use")], [
        ConnectAttempt("n2", "n1", 29500, "master", "refused", 0.001, "connection refused")])
    assert [(r.name, r.nodes, r.status) for r in rows] == [
        ("listen on n1", ("n1",), "fail"), ("master port", ("n2",), "fail")]
    assert "address in use" in rows[0].detail
    assert rows[1].detail == ("n2 cannot connect to the master n1:29500: refused "
                              "(connection refused)")


def test_shape_of_a_real_plan() -> None:
    inv = inventory([{"name": "alpha", "address": "10.0.0.1",
                      "gpus": [{"model": "RTX-3090", "memory_gb": 24, "count": 3}]},
                     {"name": "beta", "address": "10.0.0.2",
                      "gpus": [{"model": "RTX-3090", "memory_gb": 24, "count": 2}]}],
                    network={"interface": "eth0", "fabric": "ethernet", "gbps": 10})
    job = JobSpec.model_validate({"name": "j", "resources": {"nodes": 2, "gpus_per_node": "all"},
                                  "command": ["python", "train.py"], "backend": "ssh"})
    plan = make_plan(job, inv, job_id="j-1", run_dir="/r", workdir="/w")
    got = shape_of(plan, inv)
    assert got.names == ("alpha", "beta") and got.backend == "nccl"
    assert [n.nproc for n in got.nodes] == [3, 2]
    assert got.nodes[1].interface == "eth0" and got.master_addr == "10.0.0.1"
    assert got.world_size == 5


def test_nodes_named_by_group_rank_are_matched_by_position() -> None:
    inv = inventory([{"name": "n[1-3]", "slots": 1}], **GBE25)
    names = ("node 0", "node 1", "node 2")
    pairs = matrix(names, {("node 2", "node 0"): 0.4, ("node 2", "node 1"): 0.4}, 2.8)
    rows, _ = judge_bandwidth(result(names, backend="gloo", pairs=pairs), shape(inv, "gloo"))
    assert rows[0].name == "node node 2" and rows[0].status == "fail"
    assert rows[0].expected is not None and rows[0].expected.startswith(">= 2.5 GB/s")
