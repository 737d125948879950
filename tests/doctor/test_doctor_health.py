"""The doctor's health tier (orchestrate.doctor.health_tier) on the node reports a checkup's
leaders print: the recorded sick-GPU cases (tests/hostside/gpuhealth/) judged as rows."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrate.core.spec.inventory import Node
from orchestrate.doctor import findings
from orchestrate.doctor.grading import JobShape, PlannedNode
from tests.support.fakesmi import health_facts

pytestmark = pytest.mark.unit

END = findings.JobEnd("COMPLETED")


def _assess(case: str, planned: tuple[int, ...], kernel: str | None = "") -> list[Any]:
    shape = JobShape((PlannedNode("ambers", Node(name="ambers", address="10.0.0.1"),
                                  nproc=len(planned), gpu_indices=planned),), "nccl")
    report = {"kind": "node", "node": "ambers", "gpu_health": health_facts(case, kernel)}
    checks, _ = findings.assess(shape, ("health",), [report], END)
    return [(c.name, c.status, c.detail) for c in checks]


def test_a_healthy_node_is_one_passing_row_that_says_what_it_could_not_check() -> None:
    [row] = _assess("healthy", (0, 1), kernel=None)
    assert row[:2] == ("gpus", "pass")
    assert row[2].startswith("ambers: GPU(s) 0,1,2,3,4,5,6,7 healthy (the kernel log is not "
                             "readable here")


def test_a_planned_sick_gpu_fails_an_unplanned_one_warns_and_slow_ones_warn() -> None:
    rows = {name: (status, detail) for name, status, detail in
            _assess("everything", (4, 5))}
    assert rows["gpu 5"][0] == "fail"
    assert rows["gpu 5"][1].startswith("ambers: GPU 5 (RTX A6000, 00000000:A1:00.0): 2 "
                                       "uncorrectable ECC errors since boot and a row remap")
    assert rows["gpu 0"] == ("warn", "ambers: (not planned: the job runs around it) GPU 0 "
                             "(A100 80GB PCIe, 00000000:01:00.0): a row remap that failed: "
                             "the GPU should be replaced: tell the server's admin; until "
                             "then orchestrate will not place ranks on it")
    assert rows["gpu 4"][0] == rows["gpu 3"][0] == "warn"
    assert rows["gpus"][0] == "pass" and "GPU(s) 1,2 healthy" in rows["gpus"][1]


def test_a_node_without_a_health_report_warns() -> None:
    shape = JobShape((PlannedNode("a", Node(name="a", address="10.0.0.1"), nproc=1,
                                  gpu_indices=(0,)),), "nccl")
    [check] = findings.assess(shape, ("health",), [], END)[0]
    assert (check.tier, check.status) == ("health", "warn")
