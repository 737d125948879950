"""The planner around GPUs that failed their health check (Occupancy.sick, from
orchestrate.core.gpuhealth): never placed on; a job takes other free GPUs, or is refused for
good (exit 2, not "try again later") with the sick GPU's sentence; the plan says what it left
out."""

from __future__ import annotations

import pytest

from orchestrate.core.errors import UserError
from orchestrate.core.gpuhealth import judge
from orchestrate.core.plan.plan import Occupancy
from tests.support.fakesmi import health_facts
from tests.support.plans import A100, A6000, gpu_node, inventory, job, plan

pytestmark = pytest.mark.unit

AMBERS = inventory({"name": "ambers", "gpus": [{**A100, "indices": [0, 1]},
                                               {**A6000, "indices": [2, 3, 4, 5, 6, 7]}]})
SICK = Occupancy(sick={"ambers": judge(health_facts("remap-pending"), range(8)).sick()})


def test_a_job_is_planned_around_a_sick_gpu_and_the_plan_says_so() -> None:
    p = plan(job(resources={"gpu_model": "RTX-A6000", "gpus_per_node": 4}), AMBERS,
             occupancy=SICK)
    assert p.nodes[0].gpu_indices == (2, 3, 4, 6)
    [note] = [n for n in p.notes if "left out" in n]
    assert note.startswith("ambers: left out GPU 5 (RTX A6000, 00000000:A1:00.0): 2 "
                           "uncorrectable ECC errors since boot and a row remap pending")


def test_a_job_asking_for_every_gpu_of_the_model_is_refused_naming_the_sick_one() -> None:
    with pytest.raises(UserError) as refused:
        plan(job(resources={"gpu_model": "RTX-A6000", "gpus_per_node": 6}), AMBERS,
             occupancy=SICK)
    assert refused.value.exit_status == 2  # for good: waiting does not heal a GPU
    message = str(refused.value)
    assert "5 usable GPU(s) (1 failed the health check), 6 requested" in message
    assert "GPU 5 (RTX A6000, 00000000:A1:00.0)" in message
    assert "until then orchestrate will not place ranks on it" in message


def test_held_and_sick_together_is_a_wait_only_when_the_held_ones_would_do() -> None:
    held = Occupancy(sick=SICK.sick, busy_gpus={"ambers": frozenset({2})})
    with pytest.raises(UserError) as refused:
        plan(job(resources={"gpu_model": "RTX-A6000", "gpus_per_node": 5}), AMBERS,
             occupancy=held)
    assert refused.value.exit_status == 75  # GPU 2 frees up; 5 healthy A6000s exist
    with pytest.raises(UserError) as never:
        plan(job(resources={"gpu_model": "RTX-A6000", "gpus_per_node": 6}), AMBERS,
             occupancy=held)
    assert never.value.exit_status == 2


def test_gpus_per_node_all_takes_the_healthy_ones_and_says_which_it_left() -> None:
    p = plan(job(resources={"nodes": 1, "gpus_per_node": "all"}),
             inventory(gpu_node("ambers", 8, A6000)), occupancy=SICK)
    assert p.nodes[0].gpu_indices == (0, 1, 2, 3, 4, 6, 7)
    assert any("left out GPU 5" in n for n in p.notes)


def test_a_sick_gpu_of_another_model_is_not_said_to_be_left_out() -> None:
    p = plan(job(resources={"gpu_model": "A100-80GB", "gpus_per_node": 2}), AMBERS,
             occupancy=SICK)
    assert p.nodes[0].gpu_indices == (0, 1)
    assert not any("left out" in n for n in p.notes)
