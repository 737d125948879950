"""The GPU health check against the real nvidia-smi of a machine with GPUs (the GPU tier): every
field asked is one this driver knows (or is named as dropped), every cell reads as the verdicts
expect, and on a healthy machine (a lent H100, one GPU or eight) no GPU fails: each passes, or
only warns with its reasons said.

Only what holds on any healthy box is asserted: a field the driver reports as ``[N/A]`` (retired
pages on a GPU that remaps rows, a PCIe width in some VMs) is no value, the kernel log may be
unreadable in a container (said in the notes), and the GPUs nvidia-smi lists may be more than
torch sees (``CUDA_VISIBLE_DEVICES``)."""

from __future__ import annotations

import pytest

from orchestrate.core.gpuhealth import PASS, WARN, judge
from orchestrate.hostside import gpuhealth
from orchestrate.hostside.smicsv import number, value
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
        for field in ("pcie.link.width.current", "pcie.link.width.max"):
            assert value(row[field]) is None or number(row[field]) is not None, (field, row[field])
    log = found["kernel_log"]
    assert log["readable"] or "not readable" in log["detail"]
    health = judge(found, range(GPUS))
    assert len(health.gpus) == len(found["gpus"])
    print({g.index: g.line for g in health.gpus}, health.notes, f"{found['seconds']}s")
    for gpu in health.gpus:
        assert gpu.status in (PASS, WARN), gpu.line
        assert gpu.line.startswith(f"GPU {gpu.index} (")
        assert (gpu.status == WARN) == bool(gpu.findings), gpu.line
        assert all(f.severity == WARN and f.seen and f.action for f in gpu.findings), gpu.line
    assert all(note for note in health.notes)
    assert health.sick() == {}
