"""What the model probe's answers become in the plan: a failed or unfinished trace is one note
naming the layouts and the reason (issue #34: `plan` showed it only under --json)."""

from __future__ import annotations

import json
import queue
import time

import pytest

from orchestrate.train.modelfacts import _collect

pytestmark = pytest.mark.unit

FACTS = {"facts": {"params": 1e6, "largest_unit": 1e5}}


def _peak(layout: str) -> dict[str, object]:
    return {"traced": {"option": layout, "world_size": 2, "batch": 1, "weights": 1.0,
                       "gradients": 1.0, "optimizer": 2.0, "gathered": 0.0,
                       "activations": 1.0}}


def _answers(*answers: object, end: bool = True) -> queue.Queue[str | None]:
    lines: queue.Queue[str | None] = queue.Queue()
    for answer in answers:
        lines.put(json.dumps(answer))
    if end:
        lines.put(None)
    return lines


def test_failed_traces_are_one_note_per_reason_naming_the_layouts() -> None:
    lines = _answers(FACTS, _peak("ddp"), {"error": "RuntimeError: boom"},
                     {"error": "RuntimeError: boom"})
    facts, skipped = _collect(lines, time.monotonic() + 5, 5, ["ddp", "fsdp", "fsdp+ac"], "j", [])
    assert facts is not None and skipped == ""
    assert facts.trace("ddp") is not None and facts.trace("fsdp") is None
    assert facts.notes == ("tracing fsdp, fsdp+ac failed (RuntimeError: boom): estimated by "
                           "the formula",)


def test_a_deadline_names_the_layouts_left() -> None:
    lines = _answers(FACTS, _peak("ddp"), end=False)
    facts, _ = _collect(lines, time.monotonic() + 0.2, 7, ["ddp", "fsdp", "fsdp+ac"], "j", [])
    assert facts is not None
    assert facts.notes == ("tracing stopped at the 7 s limit (train.memory_trace_s) before "
                           "fsdp, fsdp+ac: estimated by the formula",)


def test_a_probe_that_exits_is_not_called_slow() -> None:
    facts, skipped = _collect(_answers(), time.monotonic() + 5, 5, ["ddp"], "j", [])
    assert facts is None and "exited without an answer" in skipped
    facts, _ = _collect(_answers(FACTS), time.monotonic() + 5, 5, ["ddp", "fsdp"], "j", [])
    assert facts is not None
    assert facts.notes == ("tracing stopped when the model probe exited (out of memory?) "
                           "before ddp, fsdp: estimated by the formula",)
