"""Gathering the GPUs' health where they run (orchestrate.hostside.gpuhealth): the health query
and the kernel log, through stand-in ``nvidia-smi``, ``dmesg`` and ``journalctl`` replaying the
recorded cases (tests/hostside/gpuhealth/), as the local supervisor and the SSH agent run it."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrate.core.gpuhealth import FAIL, WARN, judge
from orchestrate.hostside import gpuhealth
from tests.support.fakesmi import health_facts, replay_health

pytestmark = pytest.mark.process


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    return tmp_path


def gathered(folder: Path, case: str, kernel: str | None = "") -> dict[str, object]:
    replay_health(folder, case, kernel)
    found = gpuhealth.gather(5.0)
    assert isinstance(found.pop("seconds"), float)
    return found


def test_what_is_gathered_is_what_the_recorded_case_says(on_path: Path) -> None:
    assert gathered(on_path, "everything") == health_facts("everything")


def test_a_kernel_log_refused_to_a_plain_user_is_said(on_path: Path) -> None:
    found = gathered(on_path, "healthy", kernel=None)
    log = found["kernel_log"]
    assert isinstance(log, dict) and log["readable"] is False
    assert log["detail"] == (
        "the kernel log is not readable here (dmesg: dmesg: read kernel buffer failed: "
        "Operation not permitted (exit status 1); journalctl -k: No journal files were opened "
        "due to insufficient permissions. (exit status 1))")
    assert judge(found).sick() == {}


def test_an_older_driver_is_asked_the_throttle_reason_names(on_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """Before driver 535 the clock reasons are ``clocks_throttle_reasons.*``; a field the
    driver does not know at all is left out and said."""
    replay_health(on_path, "hw-slowdown")
    query = on_path / "nvsmi" / "query.csv"
    query.write_text(query.read_text().replace("clocks_event_reasons.", "clocks_throttle_reasons."))
    monkeypatch.setenv("FAKE_NVSMI_UNKNOWN", "clocks_event_reasons.hw_slowdown,"
                       "remapped_rows.failure")
    found = gpuhealth.gather(5.0)
    assert found["status"] == "ok" and found["dropped"] == ["remapped_rows.failure"]
    health = judge(found, range(8))
    assert {g.index: g.status for g in health.gpus if g.findings} == {3: WARN}
    assert health.notes == ("this driver does not report remapped_rows.failure: those checks "
                            "were not made",)


def test_no_nvidia_smi_is_no_gpus_and_a_failing_one_is_said(on_path: Path) -> None:
    assert gpuhealth.gather(5.0)["status"] == "missing"
    replay_health(on_path, "healthy")
    (on_path / "nvsmi" / "stdout.txt").write_text(
        "Failed to initialize NVML: Driver/library version mismatch\n")
    found = gpuhealth.gather(5.0)
    assert found["status"] == "failed"
    assert judge(found).notes == ("GPU health not checked: nvidia-smi failed: Failed to "
                                  "initialize NVML: Driver/library version mismatch (exit "
                                  "status 18)",)


def test_a_sick_gpu_fails_through_the_whole_path(on_path: Path) -> None:
    health = judge(gathered(on_path, "remap-pending"), range(8))
    assert list(health.sick()) == [5] and health.gpus[5].status == FAIL
