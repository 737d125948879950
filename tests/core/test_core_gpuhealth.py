"""The GPU health verdicts (orchestrate.core.gpuhealth) on nvidia-smi's health fields and the
kernel log's Xid lines of sick GPUs, each failure class alone and all together, recorded in
nvidia-smi's CSV format (tests/hostside/gpuhealth/SOURCE.md): what fails, what only warns, what
is noise, and the one sentence a person reads."""

from __future__ import annotations

import pytest

from orchestrate.core.gpuhealth import FAIL, PASS, WARN, judge
from tests.support.fakesmi import health_facts

pytestmark = pytest.mark.unit

ALL = tuple(range(8))


def statuses(case: str, kernel: str | None = "") -> dict[int, str]:
    health = judge(health_facts(case, kernel), ALL)
    return {g.index: g.status for g in health.gpus if g.status != PASS}


def test_a_healthy_server_at_idle_passes_with_its_pcie_generation_dropped() -> None:
    """Gen 1 of 4 at idle is power saving, persistence off a slow start: neither is a finding."""
    health = judge(health_facts("healthy"), ALL)
    assert [g.status for g in health.gpus] == [PASS] * 8
    assert health.sick() == {} and health.warnings() == [] and health.notes == ()


@pytest.mark.parametrize(("case", "expected"), [
    ("ecc-volatile", {0: WARN}),
    ("ecc-aggregate-only", {}),
    ("remap-pending", {5: FAIL}),
    ("retired-pending", {1: FAIL}),
    ("remap-failure", {0: FAIL}),
    ("hw-slowdown", {3: WARN}),
    ("power-brake", {2: WARN}),
    ("pcie-x4", {4: WARN}),
    ("fallen-off-bus", {6: FAIL}),
    ("xid-app", {}),
    ("everything", {0: FAIL, 3: WARN, 4: WARN, 5: FAIL, 6: FAIL, 7: FAIL}),
])
def test_each_failure_class_alone_and_together(case: str, expected: dict[int, str]) -> None:
    assert statuses(case) == expected


def test_the_sentence_names_the_gpu_model_and_bus_and_says_what_to_do() -> None:
    [line] = judge(health_facts("remap-pending"), ALL).sick().values()
    assert line == ("GPU 5 (RTX A6000, 00000000:A1:00.0): 2 uncorrectable ECC errors since boot "
                    "and a row remap pending: reboot the server (or reset the GPU) to remap; "
                    "until then orchestrate will not place ranks on it")


def test_warnings_say_why_the_gpu_is_slower() -> None:
    [width] = judge(health_facts("pcie-x4"), ALL).warnings()
    assert "GPU 4 (RTX A6000, 00000000:81:00.0): a PCIe link at x4 of x16: reseat" in width
    [slow] = judge(health_facts("hw-slowdown"), ALL).warnings()
    assert "held in a hardware slowdown and held in a thermal slowdown" in slow


def test_a_gpu_gone_from_nvidia_smi_fails_and_its_xid_is_matched_by_bus() -> None:
    health = judge(health_facts("everything"), ALL)
    sick = health.sick()
    assert "listed in the inventory but not by nvidia-smi" in sick[6]
    assert "a double-bit ECC error (Xid 48) since boot" in sick[7]
    assert "a row remap that failed" in sick[0]


def test_an_unreadable_kernel_log_is_said_not_failed() -> None:
    health = judge(health_facts("healthy", kernel=None), ALL)
    assert health.sick() == {}
    assert health.notes == ("the kernel log is not readable here (dmesg: dmesg: read kernel "
                            "buffer failed: Operation not permitted): Xid errors not checked",)


def test_a_driver_without_some_fields_says_which_checks_were_not_made() -> None:
    facts = {**health_facts("healthy"), "dropped": ["remapped_rows.pending"]}
    assert judge(facts).notes[0] == ("this driver does not report remapped_rows.pending: those "
                                     "checks were not made")
    assert judge({"status": "failed", "error": "nvidia-smi failed: x"}).notes == (
        "GPU health not checked: nvidia-smi failed: x",)
    assert judge({"status": "missing"}).gpus == ()


def test_the_document_round_trips_the_sick_set() -> None:
    from orchestrate.core.gpuhealth import sick_on

    health = judge(health_facts("everything"), ALL)
    assert sick_on(health.to_json()) == health.sick()


@pytest.mark.parametrize("missing", ["[N/A]", "[Not Supported]", "N/A", ""])
def test_a_cell_nvidia_smi_leaves_empty_is_no_finding_as_it_is_no_value_to_the_gatherers(
        missing: str) -> None:
    """The verdicts read cells with the gatherers' reader (hostside/smicsv.py), not a copy:
    what is no value there is no count, no pending remap and no link width here."""
    from orchestrate.hostside import smicsv

    assert smicsv.value(missing) is None and smicsv.number(missing) is None
    facts = health_facts("healthy")
    row = facts["gpus"][0]
    for name in ("ecc.errors.uncorrected.volatile.total", "retired_pages.pending",
                 "remapped_rows.pending", "remapped_rows.failure", "pcie.link.width.current"):
        row[name] = missing
    row["clocks_event_reasons.hw_slowdown"] = "Active"  # the row is still read
    [gpu0] = [g for g in judge(facts, ALL).gpus if g.index == 0]
    assert [f.seen for f in gpu0.findings] == ["held in a hardware slowdown"]
