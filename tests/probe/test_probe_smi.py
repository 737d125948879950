"""Reading nvidia-smi's CSV the one way (orchestrate.hostside.smi): the GPU query the probe
parses and the GPU-use check's two queries read the same cells, so a model name, a missing
value or a process name with a comma mean the same in both."""

from __future__ import annotations

import pytest

from orchestrate.hostside import gpuuse, hostfacts, smi
from orchestrate.probe.facts import parse_gpu_query
from tests.support.probemachine import FIXTURES

pytestmark = pytest.mark.unit


def test_a_header_names_the_columns_without_their_units() -> None:
    text = "index, name, memory.total [MiB]\n0, NVIDIA RTX A6000, 49140\n"
    assert smi.rows(text) == [{"index": "0", "name": "NVIDIA RTX A6000", "memory.total": "49140"}]
    assert smi.rows(text, ["index", "name", "memory.total"]) == smi.rows(text)


def test_without_a_header_the_fields_asked_name_the_columns() -> None:
    text = "0, NVIDIA RTX A6000, 49140\n\n1, NVIDIA A100 80GB PCIe, 81920\n"
    rows = smi.rows(text, ["index", "name", "memory.total"])
    assert [r["name"] for r in rows] == ["NVIDIA RTX A6000", "NVIDIA A100 80GB PCIe"]


def test_fields_asked_win_over_the_aliases_nvidia_smi_heads_them_with() -> None:
    """``used_memory`` comes back headed ``used_gpu_memory``: the row is keyed as asked."""
    text = ("pid, used_gpu_memory [MiB], process_name\n"
            "4242, 30720, /opt/conda/bin/python -c a,b\n")
    [row] = smi.rows(text, (*gpuuse.APP_FIELDS[:2], "process_name"))
    assert row == {"pid": "4242", "used_memory": "30720",
                   "process_name": "/opt/conda/bin/python -c a,b"}


def test_a_short_row_is_left_out_and_missing_values_are_none() -> None:
    assert smi.rows("index, name\n0\n1, x\n") == [{"index": "1", "name": "x"}]
    assert smi.rows("") == []
    assert [smi.value(c) for c in ("[N/A]", "[Not Supported]", "N/A", " ", "Disabled")] == [
        None, None, None, None, "Disabled"]
    assert [smi.number(c) for c in ("81920", "81920 MiB", "[N/A]", "x", None)] == [
        81920.0, 81920.0, None, None, None]


def test_the_probe_and_the_use_check_read_the_same_model_cells() -> None:
    """The mixed lab server's query, read by the probe and as the use check reads its rows."""
    text = (FIXTURES / "ambers-a100-a6000" / "query.csv").read_text()
    probed = parse_gpu_query(text, list(hostfacts.GPU_FIELDS))
    rows = smi.rows(text)
    assert [g.name for g in probed] == [r["name"] for r in rows]
    assert [g.model for g in probed] == ["A100-80GB"] * 2 + ["RTX-A6000"] * 6


def test_a_failure_is_one_sentence() -> None:
    assert smi.message(18, "Failed to initialize NVML: Driver/library version mismatch", "") \
        == "Failed to initialize NVML: Driver/library version mismatch (exit status 18)"
    assert smi.message(smi.NO_STATUS, "", "nvidia-smi did not answer within 5s") \
        == "nvidia-smi did not answer within 5s"
    assert smi.message(2, "", "") == "exit status 2"
    assert smi.said({"status": "failed", "error": "NVML: mismatch (exit status 18)"}) \
        == "nvidia-smi failed: NVML: mismatch (exit status 18)"
    assert smi.said({"status": "missing", "error": "nvidia-smi not found on PATH"}) \
        == "nvidia-smi not found on PATH"
