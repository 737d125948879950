"""The planner, called directly: ranks, GPUs, master address and port, backend, environment."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrate.core.plan.plan import Occupancy
from orchestrate.core.plan.ports import PORT_BASE, PORT_SPAN, derive_port
from tests.support.plans import A100, A6000, gpu_node, inventory, job, plan, refusal

pytestmark = pytest.mark.unit

LAB = inventory(
    {"name": "ambers",
     "gpus": [{**A100, "indices": [0, 1]}, {**A6000, "indices": [2, 3, 4, 5, 6, 7]}]},
    gpu_node("birch", 4, A6000),
)


# ---------------------------------------------------------------- ranks and nodes


def test_uneven_nodes_number_ranks_contiguously() -> None:
    p = plan(job(resources={"nodes": 2, "gpus_per_node": "all"}),
             inventory(gpu_node("a", 3), gpu_node("b", 2)))
    assert p.world_size == 5
    assert [(r.rank, r.local_rank, r.node, r.node_rank) for r in p.ranks] == [
        (0, 0, "a", 0), (1, 1, "a", 0), (2, 2, "a", 0), (3, 0, "b", 1), (4, 1, "b", 1)
    ]
    a, b = p.nodes
    assert (a.nproc, a.first_rank, a.env["LOCAL_WORLD_SIZE"], a.env["GROUP_RANK"]) == (
        3, 0, "3", "0"
    )
    assert (b.nproc, b.first_rank, b.env["LOCAL_WORLD_SIZE"], b.env["GROUP_RANK"]) == (
        2, 3, "2", "1"
    )
    assert (a.cuda_visible_devices, b.cuda_visible_devices) == ("0,1,2", "0,1")
    assert p.env["WORLD_SIZE"] == "5"
    assert not p.uniform


def test_nodes_keep_inventory_order_and_node_names_order() -> None:
    inv = inventory(gpu_node("n[1-4]", 2))
    assert [n.name for n in plan(job(resources={"nodes": 3}), inv).nodes] == ["n1", "n2", "n3"]
    named = plan(job(resources={"nodes": 2, "node_names": ["n4", "n2"]}), inv)
    assert [(n.name, n.node_rank) for n in named.nodes] == [("n4", 0), ("n2", 1)]
    assert named.master_addr == "n4"


def test_node_names_take_hostlists() -> None:
    inv = inventory(gpu_node("gpu[01-16]", 8))
    p = plan(job(resources={"nodes": 4, "node_names": ["gpu[03-05]", "gpu09"]}), inv)
    assert [n.name for n in p.nodes] == ["gpu03", "gpu04", "gpu05", "gpu09"]
    assert p.slurm.nodelist == "gpu[03-05,09]"


def test_a_job_asking_fewer_gpus_gets_a_subset_in_pci_order() -> None:
    p = plan(job(resources={"gpus_per_node": 3}), inventory(gpu_node("a", 8)))
    assert p.nodes[0].gpu_indices == (0, 1, 2)
    assert p.nodes[0].cuda_visible_devices == "0,1,2"
    assert [r.gpu_index for r in p.ranks] == [0, 1, 2]


def test_gpus_held_by_other_jobs_are_not_picked() -> None:
    held = Occupancy(busy_gpus={"a": frozenset({0, 2})})
    p = plan(job(resources={"gpus_per_node": 2}), inventory(gpu_node("a", 4)), occupancy=held)
    assert p.nodes[0].cuda_visible_devices == "1,3"
    message = refusal(job(resources={"gpus_per_node": 3}), inventory(gpu_node("a", 4)),
                      occupancy=held)
    assert "2 usable GPU(s) (2 held by other jobs), 3 requested" in message


def test_cpu_slots_held_by_other_jobs_are_not_given_again() -> None:
    """CPU slots are the CPU analogue of GPUs: a 4-slot node with 3 held has 1 left."""
    inv = inventory({"name": "c", "slots": 4})
    held = Occupancy(busy_slots={"c": 3})
    assert plan(job(resources={"gpus_per_node": "all"}), inv, occupancy=held).world_size == 1
    message = refusal(job(resources={"gpus_per_node": 2}), inv, occupancy=held)
    assert "1 free slots (3 held by other jobs), 2 requested" in message
    message = refusal(job(resources={"gpus_per_node": "all"}), inv,
                      occupancy=Occupancy(busy_slots={"c": 4}))
    assert "0 free slots (4 held by other jobs)" in message


def test_exclude_failed_node_needs_a_spare_first_then_plans_without_the_failed_one() -> None:
    """Before the first attempt a spare is required; once a node is excluded, the job goes to
    the nodes left (found by the SSH restart test: a 3-node inventory, 2 nodes used)."""
    three = inventory(*({"name": n, "slots": 1} for n in ("a", "b", "c")))
    spec = job(resources={"nodes": 2, "gpus_per_node": 1},
               restart={"max": 1, "on": ["failure"], "exclude_failed_node": True})
    assert [n.name for n in plan(spec, three).nodes] == ["a", "b"]
    again = plan(spec, three, occupancy=Occupancy(excluded=frozenset({"b"})))
    assert [n.name for n in again.nodes] == ["a", "c"]
    two = inventory(*({"name": n, "slots": 1} for n in ("a", "b")))
    assert "no spare node: the job uses 2 node(s)" in refusal(spec, two)


def test_every_local_rank_sees_all_of_the_nodes_job_gpus() -> None:
    p = plan(job(resources={"gpu_model": "RTX-A6000", "node_names": ["ambers"]}), LAB)
    node = p.nodes[0]
    for rank in node.ranks:
        assert node.rank_env(rank, p.env)["CUDA_VISIBLE_DEVICES"] == "2,3,4,5,6,7"
    assert [r.gpu_index for r in node.ranks] == [2, 3, 4, 5, 6, 7]  # cuda:LOCAL_RANK -> these


# ---------------------------------------------------------------- master address and port


def test_master_is_the_first_nodes_address() -> None:
    inv = inventory(gpu_node("a", 1, address="10.0.0.7"), gpu_node("b", 1, address="10.0.0.8"))
    p = plan(job(resources={"nodes": 2}), inv)
    assert p.master_addr == p.env["MASTER_ADDR"] == "10.0.0.7"


def test_master_port_is_derived_from_the_job_id_in_range() -> None:
    inv = inventory(gpu_node("a", 1))
    ports = {plan(job(), inv, job_id=f"job-{i}").master_port for i in range(300)}
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert PORT_BASE == 20000 and PORT_BASE + PORT_SPAN == 32000
    assert len(ports) > 250  # spread out, so jobs sharing a server rarely collide
    first = plan(job(), inv, job_id="same")
    assert first.master_port == plan(job(), inv, job_id="same").master_port == derive_port("same")
    assert not first.port_fixed


def test_a_given_port_is_used_as_is() -> None:
    inv = inventory(gpu_node("a", 1))
    p = plan(job(distributed={"master_port": 29500}), inv)
    assert (p.master_port, p.env["MASTER_PORT"], p.port_fixed) == (29500, "29500", True)
    p = plan(job(distributed={"master_port": 23456, "master_addr": "head.ib"}), inv)
    assert (p.master_port, p.port_fixed, p.master_addr, p.master_addr_fixed) == (
        23456, True, "head.ib", True
    )
    assert (p.env["MASTER_PORT"], p.env["MASTER_ADDR"]) == ("23456", "head.ib")


# ---------------------------------------------------------------- process-group backend


def test_nccl_with_gpus_gloo_without() -> None:
    assert plan(job(), inventory(gpu_node("a", 2))).dist_backend == "nccl"
    cpu = plan(job(), inventory({"name": "c", "slots": 4}))
    assert cpu.dist_backend == "gloo"
    assert "CUDA_DEVICE_ORDER" not in cpu.env and "CUDA_VISIBLE_DEVICES" not in cpu.nodes[0].env
    assert cpu.world_size == 4


def test_explicit_gloo_on_gpus_warns() -> None:
    p = plan(job(distributed={"backend": "gloo"}), inventory(gpu_node("a", 2)))
    assert p.dist_backend == "gloo"
    assert any("gloo on GPUs" in w for w in p.warnings)
    assert not plan(job(), inventory(gpu_node("a", 2))).warnings


def test_nccl_on_cpu_only_nodes_is_refused() -> None:
    message = refusal(job(distributed={"backend": "nccl"}), inventory({"name": "c", "slots": 2}))
    assert "distributed.backend: nccl needs GPUs" in message


# ---------------------------------------------------------------- environment


def test_env_follows_the_inventorys_network_and_links() -> None:
    inv = inventory(
        gpu_node("eth", 2, gpu_link="none", network={"interface": "eno1", "fabric": "ethernet"}),
        gpu_node("ib", 2, gpu_link="nvswitch",
                 network={"interface": "ib0", "fabric": "infiniband", "hca": "mlx5_0"}),
        gpu_node("roce", 2, network={"interface": "ens1", "fabric": "roce"}),
        cpus=16,
    )
    p = plan(job(resources={"nodes": 3}), inv)
    eth, ib, roce = (n.env for n in p.nodes)
    assert p.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    # NCCL matches by prefix (eno1 would select eno10 too): the exact-match form; gloo plain.
    assert (eth["NCCL_SOCKET_IFNAME"], eth["GLOO_SOCKET_IFNAME"]) == ("=eno1", "eno1")
    assert eth["NCCL_IB_DISABLE"] == "1" and eth["NCCL_P2P_DISABLE"] == "1"
    assert "NCCL_IB_DISABLE" not in ib and ib["NCCL_IB_HCA"] == "=mlx5_0"
    assert "NCCL_P2P_DISABLE" not in ib
    assert "NCCL_IB_DISABLE" not in roce and "NCCL_IB_HCA" not in roce
    assert eth["OMP_NUM_THREADS"] == "8"  # 16 cpus / 2 ranks


def test_nccl_diagnostics_are_rendered_and_debug_is_opt_in() -> None:
    inv = inventory(gpu_node("a", 2, network={"interface": "^docker0,lo", "fabric": "roce"}))
    p = plan(job(), inv)
    assert p.env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert p.env["TORCH_FR_DUMP_TEMP_FILE"] == "/runs/j-1/diag/fr/nccl_rank_"
    assert p.nodes[0].env["NCCL_SOCKET_IFNAME"] == "^docker0,lo"  # an exclusion stays as written
    assert "NCCL_DEBUG" not in p.env and "TORCH_DISTRIBUTED_DEBUG" not in p.env
    debug = plan(job(), inv, debug=True)
    assert debug.env["NCCL_DEBUG"] == "INFO" and debug.env["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    assert debug.env["NCCL_DEBUG_FILE"] == "/runs/j-1/nccl/%h.%p.log"
    assert debug.env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"


def test_every_rank_has_the_torchrun_variables() -> None:
    p = plan(job(resources={"nodes": 2}), inventory(gpu_node("a", 3), gpu_node("b", 2)))
    for node in p.nodes:
        for rank in node.ranks:
            env = node.rank_env(rank, p.env)
            assert env["RANK"] == str(rank.rank)
            assert env["LOCAL_RANK"] == str(rank.local_rank)
            assert env["WORLD_SIZE"] == "5"
            assert env["LOCAL_WORLD_SIZE"] == str(node.nproc)
            assert env["GROUP_RANK"] == str(node.node_rank)
            assert env["MASTER_ADDR"] == "a" and env["MASTER_PORT"] == str(p.master_port)


def test_the_jobs_env_overrides_any_of_it() -> None:
    inv = inventory(gpu_node("a", 2, network={"interface": "eno1"}), cpus=8)
    p = plan(job(env={"NCCL_SOCKET_IFNAME": "eth9", "OMP_NUM_THREADS": 7, "CUDA_DEVICE_ORDER":
                      "FASTEST_FIRST", "NCCL_IB_DISABLE": False, "EXTRA": 1.5}), inv)
    node = p.nodes[0]
    env = node.rank_env(node.ranks[0], p.env)
    assert env["NCCL_SOCKET_IFNAME"] == "eth9"
    assert env["OMP_NUM_THREADS"] == "7"
    assert env["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"
    assert env["NCCL_IB_DISABLE"] == "0"
    assert env["EXTRA"] == "1.5"


def test_rank_and_local_rank_cannot_be_overridden() -> None:
    with pytest.raises(ValueError, match="set per rank by the planner"):
        job(env={"LOCAL_RANK": 1})


# ---------------------------------------------------------------- heterogeneous GPUs


def test_gpu_model_filters_a_mixed_server() -> None:
    p = plan(job(resources={"gpu_model": "rtx-a6000"}), LAB)  # case does not matter
    assert p.nodes[0].name == "ambers" and p.nodes[0].cuda_visible_devices == "2,3,4,5,6,7"
    p = plan(job(resources={"gpu_model": "A100-80GB"}), LAB)
    assert p.nodes[0].cuda_visible_devices == "0,1"


def test_memory_floor_filters_gpus() -> None:
    p = plan(job(resources={"min_gpu_memory_gb": 60}), LAB)
    assert set(p.nodes[0].gpu_models) == {"A100-80GB"}
    assert p.nodes[0].gpu_indices == (0, 1)


def test_models_are_never_mixed_across_ranks_unless_allowed() -> None:
    two = job(resources={"nodes": 2})
    p = plan(two, LAB)  # A100s exist on one node only: the A6000s on both are picked
    assert {m for n in p.nodes for m in n.gpu_models} == {"RTX-A6000"}
    assert any("picked GPU model RTX-A6000" in note for note in p.notes)
    assert not p.warnings
    mixed = plan(job(resources={"nodes": 2, "allow_mixed_gpus": True}), LAB)
    assert mixed.world_size == 12
    assert any("GPU models are mixed" in w for w in mixed.warnings)


def test_allow_mixed_gpus_never_mixes_gpu_and_cpu_only_nodes() -> None:
    inv = inventory(gpu_node("g", 2), {"name": "c", "slots": 8})
    message = refusal(job(resources={"nodes": 2, "allow_mixed_gpus": True}), inv)
    assert "2 nodes requested" in message and "1 match" in message
    cpu_only = inventory({"name": "c1", "slots": 2}, {"name": "c2", "slots": 2})
    p = plan(job(resources={"nodes": 2, "allow_mixed_gpus": True}), cpu_only)
    assert p.dist_backend == "gloo" and p.world_size == 4


def test_cross_file_refusals_say_what_exists() -> None:
    message = refusal(job(resources={"gpu_model": "A100-40GB"}), LAB)
    assert "gpu_model 'A100-40GB' not in inventory 't'; models there: A100-80GB (2), " \
           "RTX-A6000 (10)" in message
    message = refusal(job(resources={"nodes": 3}), LAB)
    assert "3 nodes requested (all GPUs each), 2 match" in message
    message = refusal(job(resources={"node_names": ["cedar"]}), LAB)
    assert "node 'cedar' not in inventory 't'" in message and "ambers, birch" in message


# ---------------------------------------------------------------- memory


def _train(**extra: Any) -> dict[str, Any]:
    return {"model": "m:f", "dataset": "d:f", **extra}


def test_a_model_that_does_not_fit_is_refused_with_numbers() -> None:
    spec = job(command=None, train=_train(model_params=6.7e9), resources={"gpu_model": "RTX-A6000"})
    message = refusal(spec, LAB)
    assert "6.7e9 parameters with AdamW in fp32 need ~107 GB per GPU before activations" in message
    assert "RTX-A6000 has 51.5 GB (48 GiB)" in message
    assert "bf16-true" in message and "sgd" in message and "FSDP" in message  # remedies


def test_the_planner_picks_the_gpus_a_model_fits() -> None:
    # 2.5e9 params x 16 bytes + 2 GB = 42 GB: fits both; 3e9 -> 50 GB: only the A100s
    small = plan(job(command=None, train=_train(model_params=2.5e9)), LAB)
    assert small.memory is not None and small.memory.total < 48e9
    big = plan(job(command=None, train=_train(model_params=3e9), resources={"nodes": 1}), LAB)
    assert set(big.nodes[0].gpu_models) == {"A100-80GB"}
    assert big.nodes[0].cuda_visible_devices == "0,1"


def test_plan_json_has_the_documented_shape() -> None:
    uneven = inventory(gpu_node("a", 3), gpu_node("b", 2))
    data = plan(job(resources={"nodes": 2}), uneven).to_json()
    for key in ("world_size", "backend", "dist_backend", "master_addr", "master_port", "nodes",
                "ranks", "env"):
        assert key in data
    for node in data["nodes"]:
        assert {"name", "address", "node_rank", "nproc", "cuda_visible_devices",
                "gpu_models"} <= set(node)
        assert node["cuda_visible_devices"] is None or isinstance(node["cuda_visible_devices"], str)
    for rank in data["ranks"]:
        assert {"rank", "local_rank", "node", "node_rank"} <= set(rank)
