"""The GPU health check against the real nvidia-smi of a machine with GPUs (the GPU tier): every
field asked is one this driver knows (or is named as dropped), every cell reads as the verdicts
expect, and the verdict on each GPU is one of pass/warn/fail with its sentence."""

from __future__ import annotations

import pytest

from orchestrate.core.gpuhealth import FAIL, PASS, WARN, judge
from orchestrate.hostside import gpuhealth
from orchestrate.hostside.smi import number, value
from tests.support.gpus import GPUS, needs_gpu

pytestmark = pytest.mark.gpu

YES_NO = {None, "yes", "no"}
ACTIVE = {None, "active", "not active"}


@needs_gpu("the health check reads the real nvidia-smi")
def test_the_real_nvidia_smi_answers_the_health_query_and_every_gpu_is_judged() -> None:
    found = gpuhealth.gather()
    assert found["status"] == "ok", found["error"]
    assert len(found["gpus"]) >= GPUS
    assert set(found["fields"]) | set(found["dropped"]) == set(gpuhealth.HEALTH_FIELDS)
    for row in found["gpus"]:
        assert row["index"].isdigit() and value(row["pci.bus_id"])
        for field in ("retired_pages.pending", "remapped_rows.pending", "remapped_rows.failure"):
            cell = value(row.get(field))
            assert cell is None or cell.lower() in YES_NO or number(cell) is not None, (field, cell)
        for field in [f for f in row if f.startswith("clocks_event_reasons.")]:
            assert (value(row[field]) or "").lower() in ACTIVE | {""}, (field, row[field])
        assert number(row["pcie.link.width.max"]) is not None
    log = found["kernel_log"]
    assert log["readable"] or "not readable" in log["detail"]
    health = judge(found, range(GPUS))
    assert len(health.gpus) == len(found["gpus"])
    for gpu in health.gpus:
        assert gpu.status in (PASS, WARN, FAIL)
        assert gpu.line.startswith(f"GPU {gpu.index} (")
    print({g.index: g.line for g in health.gpus}, health.notes, f"{found['seconds']}s")
