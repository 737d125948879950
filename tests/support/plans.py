"""The planner called directly, as the plan tests call it: inventories of GPU nodes, job specs,
the plan of one, and the one problem of a refused one. Shared by the tests of the plan and of
its launcher (tests/core/test_core_plan.py, test_core_launch.py), so neither imports the other.
"""

from __future__ import annotations

from typing import Any

import pytest

from orchestrate.core.errors import UserError
from orchestrate.core.plan.plan import Plan, make_plan
from orchestrate.core.spec.inventory import Inventory, InventorySpec, resolve_inventory
from orchestrate.core.spec.job import JobSpec

A100 = {"model": "A100-80GB", "memory_gb": 80}
A6000 = {"model": "RTX-A6000", "memory_gb": 48}


def inventory(*nodes: dict[str, Any], **defaults: Any) -> Inventory:
    spec = InventorySpec.model_validate({"name": "t", "defaults": defaults, "nodes": list(nodes)})
    return resolve_inventory(spec)


def gpu_node(name: str, count: int, model: dict[str, Any] = A100, **extra: Any) -> dict[str, Any]:
    return {"name": name, "gpus": [{**model, "count": count}], **extra}


def job(**fields: Any) -> JobSpec:
    base: dict[str, Any] = {"name": "j", "backend": "ssh", "command": ["python", "train.py"]}
    return JobSpec.model_validate(base | fields)


def plan(spec: JobSpec, inv: Inventory, job_id: str = "j-1", **kw: Any) -> Plan:
    return make_plan(spec, inv, job_id=job_id, run_dir="/runs/j-1", workdir="/work", **kw)


def refusal(spec: JobSpec, inv: Inventory, **kw: Any) -> str:
    with pytest.raises(UserError) as caught:
        plan(spec, inv, **kw)
    assert len(caught.value.problems) == 1
    return caught.value.problems[0].render()
