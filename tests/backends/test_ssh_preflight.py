"""The SSH preflight's judgement of the hosts' answers (pure: the agents' answers are given as
the agent writes them, no host is asked): torch versions compared across hosts, and the
orchestrate module a command runs imported on each host, so that the odd host is the one named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrate.backends.ssh.connections import Target
from orchestrate.backends.ssh.preflight import HostAnswer, judge, orchestrate_module, request
from orchestrate.core.plan.plan import Plan
from orchestrate.core.spec.job import JobSpec
from orchestrate.run.prepare import load_spec, plan_job

pytestmark = pytest.mark.unit


def _plan(tmp_path: Path, command: list[str]) -> Plan:
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(json.dumps({"name": "three", "nodes": [
        {"name": f"h{i}", "address": f"198.18.0.{i}", "slots": 1} for i in (1, 2, 3)]}))
    job = JobSpec.model_validate({"name": "pf", "backend": "ssh", "inventory": str(inventory),
                                  "resources": {"nodes": 3, "gpus_per_node": 1},
                                  "command": command})
    return plan_job(load_spec(job, tmp_path, "pf.yaml", ()), "pf-1").plan


def _answer(name: str, torch: dict[str, Any]) -> HostAnswer:
    facts = {"python": "/usr/bin/python3 3.11.7", "workdir": {"ok": True, "path": "/w"},
             "leases": {"gpus": [], "slots": 0, "ports": [], "jobs": []},
             "interface": {"ok": True, "name": "eth0"}, "ports": {"free": [], "tried": 0},
             "torch": torch}
    return HostAnswer(Target(name, "198.18.0.9", "python3"), facts=facts)


def _ok(version: str) -> dict[str, Any]:
    return {"ok": True, "version": version, "detail": version}


def _failures(plan: Plan, torches: dict[str, dict[str, Any]]) -> dict[str, str]:
    verdict = judge(plan, {n: _answer(n, t) for n, t in torches.items()}, ())
    return {target.name: detail for target, check, detail in verdict.failures
            if check == "torch"}


def test_the_host_with_another_torch_is_refused_naming_both_versions(tmp_path: Path) -> None:
    plan = _plan(tmp_path, ["python", "train.py"])
    failed = _failures(plan, {"h1": _ok("2.13.0"), "h2": _ok("2.5.1"), "h3": _ok("2.13.0")})
    assert failed == {"h2": "torch 2.5.1 here, 2.13.0 on h1: every host must run the same torch"}
    # A tie: the master's version is the reference.
    plan2 = _plan(tmp_path, ["python", "train.py"])
    verdict = judge(plan2, {"h1": _answer("h1", _ok("2.5.1")),
                            "h2": _answer("h2", _ok("2.13.0")),
                            "h3": _answer("h3", {"ok": False, "version": None,
                                                 "detail": "ModuleNotFoundError: torch"})}, ())
    details = {t.name: d for t, c, d in verdict.failures if c == "torch"}
    assert details["h2"] == "torch 2.13.0 here, 2.5.1 on h1: every host must run the same torch"
    assert details["h3"] == "import torch failed: ModuleNotFoundError: torch"
    assert "h1" not in details


def test_the_same_torch_everywhere_passes(tmp_path: Path) -> None:
    plan = _plan(tmp_path, ["python", "train.py"])
    assert _failures(plan, {n: _ok("2.13.0+cpu") for n in ("h1", "h2", "h3")}) == {}


def test_a_command_running_an_orchestrate_module_has_it_imported_on_each_host(
        tmp_path: Path) -> None:
    checkup = _plan(tmp_path, ["python", "-m", "orchestrate.doctor.checkup", "--tier", "static"])
    node = checkup.nodes[2]
    assert orchestrate_module(checkup, node) == "orchestrate.doctor.checkup"
    assert request(checkup, node, False, False).orchestrate == "orchestrate.doctor.checkup"
    own = _plan(tmp_path, ["python", "train.py"])
    assert orchestrate_module(own, own.nodes[0]) is None
    odd = _plan(tmp_path, ["python", "-m", "orchestrate.x;import os"])
    assert orchestrate_module(odd, odd.nodes[0]) is None
    # The host whose python has torch but no orchestrate is the one named, and for what.
    failed = _failures(checkup, {
        "h1": _ok("2.13.0"), "h2": _ok("2.13.0"),
        "h3": {"ok": False, "version": "2.13.0",
               "detail": "ModuleNotFoundError: No module named 'orchestrate'"}})
    assert failed == {"h3": "import orchestrate failed: ModuleNotFoundError: No module named "
                            "'orchestrate'"}
