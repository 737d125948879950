"""The stall captures of real runs (tests/diagnosis/captures/*.json, written by the real-process
tests with ``DIAG_CAPTURE``) loaded for the pure classifier tests, which edit them in one place to
reach cases a loopback machine cannot produce (tests/diagnosis/test_diag_units.py,
test_diag_teardown.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrate.diagnosis.diagfiles import Answer, Heartbeat
from orchestrate.diagnosis.stall import classify
from orchestrate.diagnosis.stallrule import Stall

CAPTURES = Path(__file__).resolve().parents[1] / "diagnosis" / "captures"
NAMES = ["mismatch", "laggard", "frozen", "rendezvous", "train"]


def load(name: str) -> dict[str, Any]:
    """A capture with its heartbeats and answers as JSON (the variants below edit them)."""
    data: dict[str, Any] = json.loads((CAPTURES / f"{name}.json").read_text())
    data["heartbeats"] = {int(r): b for r, b in data["heartbeats"].items()}
    data["dumps"] = {int(r): d for r, d in data["dumps"].items()}
    data["nodes"] = {int(r): n for r, n in data["nodes"].items()}
    data["stall"] = Stall.from_json(data["stall"])
    return data


def beats_of(raw: dict[int, Any]) -> dict[int, Heartbeat | None]:
    return {rank: Heartbeat.from_json(beat) for rank, beat in raw.items()}


def answers_of(raw: dict[int, Any] | None) -> dict[int, Answer | None] | None:
    return None if raw is None else {rank: Answer.from_json(a) for rank, a in raw.items()}


def run_classify(data: dict[str, Any], **changes: Any) -> Any:
    args = {
        "heartbeats": data["heartbeats"], "dumps": data["dumps"], "now": data["now"],
        "nodes": data["nodes"], "master": data["master"], "interface": "lo",
        "stall": data["stall"],
    }
    args.update(changes)
    args["heartbeats"] = beats_of(args["heartbeats"])
    args["dumps"] = answers_of(args["dumps"])
    return classify(**args)
