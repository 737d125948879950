"""Properties of every plan, over random inventories and jobs (hypothesis).

Whatever the inventory and the request, a plan either is refused with a user error or numbers
ranks 0..world_size-1 contiguously by node, uses no GPU twice, and tells every rank the GPUs it
was given: the invariants torch.distributed needs and a person would check in the rank table.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from orchestrate.core.errors import UserError
from orchestrate.core.plan.plan import Occupancy, Plan, make_plan
from orchestrate.core.spec.inventory import Inventory, InventorySpec, resolve_inventory
from orchestrate.core.spec.job import JobSpec

pytestmark = pytest.mark.unit

MODELS = {"A100": 80.0, "A6000": 48.0, "T4": 16.0}


@st.composite
def gpu_groups(draw: st.DrawFn) -> list[dict[str, Any]]:
    """1-3 GPU groups of distinct models with distinct CUDA indices, in any order."""
    models = draw(st.lists(st.sampled_from(sorted(MODELS)), min_size=1, max_size=3, unique=True))
    counts = [draw(st.integers(1, 4)) for _ in models]
    indices = draw(st.permutations(list(range(sum(counts)))))
    groups, start = [], 0
    for model, count in zip(models, counts, strict=True):
        mine = indices[start : start + count]
        start += count
        group: dict[str, Any] = {"model": model, "memory_gb": MODELS[model]}
        if draw(st.booleans()) and sorted(mine) == list(range(min(mine), min(mine) + count)) \
                and min(mine) == 0 and len(models) == 1:
            group["count"] = count
        else:
            group["indices"] = list(mine)
        groups.append(group)
    return groups


@st.composite
def inventories(draw: st.DrawFn) -> Inventory:
    size = draw(st.integers(1, 6))
    nodes = []
    for i in range(size):
        node: dict[str, Any] = {"name": f"n{i}"}
        if draw(st.integers(0, 4)) == 0:
            node["slots"] = draw(st.integers(1, 6))
        else:
            node["gpus"] = draw(gpu_groups())
        if draw(st.booleans()):
            node["cpus"] = draw(st.integers(1, 64))
        nodes.append(node)
    spec = InventorySpec.model_validate({"name": "random", "nodes": nodes})
    return resolve_inventory(spec)


@st.composite
def jobs(draw: st.DrawFn, inv: Inventory) -> JobSpec:
    names = [n.name for n in inv.nodes]
    node_names = None
    if draw(st.booleans()):
        node_names = draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
    count = draw(st.integers(1, len(node_names or names)))
    resources: dict[str, Any] = {
        "nodes": count,
        "gpus_per_node": draw(st.one_of(st.just("all"), st.integers(1, 8))),
        "allow_mixed_gpus": draw(st.booleans()),
    }
    if node_names is not None:
        resources["node_names"] = node_names
    if draw(st.booleans()):
        resources["gpu_model"] = draw(st.sampled_from(sorted(MODELS)))
    if draw(st.integers(0, 3)) == 0:
        resources["min_gpu_memory_gb"] = draw(st.sampled_from([20.0, 50.0]))
    return JobSpec.model_validate(
        {"name": "prop", "backend": "ssh", "command": ["python", "t.py"], "resources": resources}
    )


@st.composite
def cases(draw: st.DrawFn) -> tuple[Inventory, JobSpec, dict[str, frozenset[int]]]:
    inv = draw(inventories())
    spec = draw(jobs(inv))
    busy: dict[str, frozenset[int]] = {}
    for node in inv.nodes:
        if node.gpus and draw(st.integers(0, 3)) == 0:
            held = draw(st.sets(st.sampled_from([g.index for g in node.gpus])))
            busy[node.name] = frozenset(held)
    return inv, spec, busy


def _plan(inv: Inventory, spec: JobSpec, busy: dict[str, frozenset[int]]) -> Plan | None:
    try:
        return make_plan(spec, inv, job_id="prop-1", run_dir="/r", workdir="/w",
                         occupancy=Occupancy(busy_gpus=busy))
    except UserError as exc:
        assert exc.problems and all(p.render() for p in exc.problems)
        return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_plan_keeps_the_rank_invariants(
    case: tuple[Inventory, JobSpec, dict[str, frozenset[int]]],
) -> None:
    inv, spec, busy = case
    plan = _plan(inv, spec, busy)
    assume(plan is not None)
    assert plan is not None
    # What crosses a process or store boundary comes back as the same value.
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    res = spec.resources
    by_name = {n.name: n for n in inv.nodes}

    # ranks exactly 0..world_size-1, world_size = sum of nproc, one entry per requested node
    assert [r.rank for r in plan.ranks] == list(range(plan.world_size))
    assert plan.world_size == sum(n.nproc for n in plan.nodes) == int(plan.env["WORLD_SIZE"])
    assert len(plan.nodes) == res.nodes
    assert len({n.name for n in plan.nodes}) == len(plan.nodes)

    first = 0
    for node_rank, node in enumerate(plan.nodes):
        # node_rank follows node order, and rank order follows node_rank
        assert node.node_rank == node_rank and node.first_rank == first
        assert [r.local_rank for r in node.ranks] == list(range(node.nproc))
        assert all(r.node_rank == node_rank and r.node == node.name for r in node.ranks)
        assert node.env["LOCAL_WORLD_SIZE"] == str(node.nproc)
        assert node.env["GROUP_RANK"] == str(node_rank)
        first += node.nproc

        source = by_name[node.name]
        if source.is_gpu:
            # no GPU used twice; each rank drives one of the node's chosen GPUs
            assert len(set(node.gpu_indices)) == len(node.gpu_indices) == node.nproc
            assert node.cuda_visible_devices == ",".join(map(str, node.gpu_indices))
            assert [r.gpu_index for r in node.ranks] == list(node.gpu_indices)
            assert set(node.gpu_indices) <= {g.index for g in source.gpus}
            assert not set(node.gpu_indices) & busy.get(node.name, frozenset())
            models = {g.index: g for g in source.gpus}
            for index in node.gpu_indices:
                gpu = models[index]
                if res.gpu_model is not None:
                    assert gpu.model.lower() == res.gpu_model.lower()
                if res.min_gpu_memory_gb is not None:
                    assert gpu.memory_gb >= res.min_gpu_memory_gb
            if res.gpus_per_node != "all":
                assert node.nproc == res.gpus_per_node
        else:
            assert node.cuda_visible_devices is None and not node.gpu_indices
            assert node.nproc <= (source.slots or 0)

    # never GPU and CPU-only nodes together; one GPU model unless mixing is allowed
    kinds = {by_name[n.name].is_gpu for n in plan.nodes}
    assert len(kinds) == 1
    assert plan.dist_backend == ("nccl" if kinds == {True} else "gloo")
    models_used = {m for n in plan.nodes for m in n.gpu_models}
    if not res.allow_mixed_gpus:
        assert len(models_used) <= 1
    elif len(models_used) > 1:
        assert any("mixed" in w for w in plan.warnings)
    if res.node_names is not None:
        order = [n for n in res.node_names if n in {p.name for p in plan.nodes}]
        assert [n.name for n in plan.nodes] == order


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=8), st.data())
def test_enough_matching_nodes_always_give_a_plan(counts: list[int], data: st.DataObject) -> None:
    """Not only sound but complete: k nodes with at least g free GPUs each -> a plan."""
    inv = resolve_inventory(
        InventorySpec.model_validate(
            {
                "name": "homogeneous",
                "nodes": [
                    {"name": f"n{i}", "gpus": [{"model": "H100", "memory_gb": 80, "count": c}]}
                    for i, c in enumerate(counts)
                ],
            }
        )
    )
    per_node = data.draw(st.integers(1, 8))
    fitting = [c for c in counts if c >= per_node]
    nodes = data.draw(st.integers(1, len(counts)))
    spec = JobSpec.model_validate(
        {"name": "c", "backend": "ssh", "command": ["x"],
         "resources": {"nodes": nodes, "gpus_per_node": per_node}}
    )
    try:
        plan = make_plan(spec, inv, job_id="c-1", run_dir="/r", workdir="/w")
    except UserError as exc:
        assert len(fitting) < nodes, exc
        assert f"{nodes} node" in str(exc) and f"{len(fitting)} match" in str(exc)
        return
    assert len(fitting) >= nodes
    assert plan.world_size == nodes * per_node
    # the first fitting nodes, in inventory order
    expected = [f"n{i}" for i, c in enumerate(counts) if c >= per_node][:nodes]
    assert [n.name for n in plan.nodes] == expected
