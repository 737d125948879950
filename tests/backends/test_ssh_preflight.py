"""The SSH preflight's judgement of the hosts' answers (pure: the agents' answers are given as
the agent writes them, no host is asked): torch versions compared across hosts, and the
orchestrate module a command runs imported on each host, so that the odd host is the one named.
The answers are records (review C2): what the agent's checks find here reads back field by
field, and an answer that does not fit is named by its field, never a KeyError.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from orchestrate.backends.sharing import host_health
from orchestrate.backends.ssh.connections import Target
from orchestrate.backends.ssh.facts import ClaimAnswer, HostFacts
from orchestrate.backends.ssh.hostcheck import preflight
from orchestrate.backends.ssh.preflight import HostAnswer, judge, orchestrate_module, request
from orchestrate.backends.ssh.wire import Preflight, WireError
from orchestrate.core.gpuhealth import sick_on
from orchestrate.core.plan.plan import Plan
from orchestrate.core.spec.job import JobSpec
from orchestrate.hostside.leases import LeaseBook, new_lease
from orchestrate.run.prepare import load_spec, plan_job
from tests.support.fakesmi import replay_health

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
    facts = {"hostname": name, "python": "/usr/bin/python3 3.11.7",
             "workdir": {"ok": True, "path": "/w"},
             "leases": {"gpus": [], "slots": 0, "ports": [], "jobs": []},
             "interface": {"ok": True, "name": "eth0"}, "ports": {"free": [], "tried": 0},
             "torch": torch}
    return HostAnswer(Target(name, "198.18.0.9", "python3"), facts=HostFacts.from_json(facts))


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


def test_the_agents_checks_of_this_host_read_back_as_the_record(tmp_path: Path) -> None:
    """The agent's own preflight, run here against a book with another job's lease and a
    bad file in it: the controller reads what it sent, typed, with the bad file named."""
    book = LeaseBook(str(tmp_path / "book"))
    book.claim(new_lease("other", "h1", [1], 0, None, [os.getpid()], None))
    (Path(book.directory) / "junk@0.json").write_text('{"gpus": 5}')
    asked = Preflight(job_id="pf-1", workdir=str(tmp_path), python="python3",
                      lease_dir=str(tmp_path / "book"), want={"gpus": [1]})
    sent = json.loads(json.dumps(preflight(asked).to_json()))  # what crosses the channel
    facts = HostFacts.from_json(sent)
    assert facts.workdir.ok and 1 in facts.leases.gpus and "other" in facts.leases.jobs
    assert facts.leases.unknown  # its owner's bad lease: honoured as holding everything
    assert facts.gpus is None and facts.torch is None  # not asked
    assert any("junk@0.json" in line for line in facts.leases.problems), facts.leases.problems


@pytest.mark.parametrize(("answer", "said"), [
    ({"hostname": "h1", "python": "p", "workdir": {"ok": True}},
     "HostFacts: workdir: Workdir: missing field path"),
    ({"hostname": "h1", "python": "p", "workdir": {"ok": True, "path": "/w"},
      "leases": {"gpus": "0,1"}}, "HostFacts: leases: LeaseFacts: gpus must be list[int]"),
    ({"hostname": "h1", "python": "p", "workdir": {"ok": True, "path": "/w"},
      "gpu_use": {"0": {"why": 3}}}, "HostFacts: gpu_use: OutsideUse: why must be str"),
])
def test_a_preflight_answer_that_does_not_fit_is_named_by_its_field(
        answer: dict[str, Any], said: str) -> None:
    with pytest.raises(WireError, match=said.replace("[", r"\[").replace("]", r"\]")):
        HostFacts.from_json(answer)


def test_a_refused_claim_reads_back_with_what_the_others_hold() -> None:
    reply = {"ok": False, "busy_gpus": [0], "busy_ports": [24411], "busy_slots": 0,
             "port_taken": True, "jobs": ["b1"], "who": {"0": "job b1 (ben, since 10:02:11)"},
             "unknown": [], "queue": [], "problems": ["junk@0.json (root): gpus must be a list"]}
    claim = ClaimAnswer.from_json(reply)
    assert not claim.ok and claim.busy_gpus == [0] and claim.port_taken
    assert claim.to_json() == reply
    with pytest.raises(WireError, match="ClaimAnswer: unknown field"):
        ClaimAnswer.from_json({**reply, "busy": True})


@pytest.mark.process  # the stand-in nvidia-smi, dmesg and journalctl run
def test_a_hosts_gpu_health_is_gathered_while_its_use_is_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lab server with GPU 5 waiting for a row remap: the agent's preflight brings its
    health back, and asks it at the same time as the GPUs' use (one nvidia-smi start paid in
    wall time, not two): the use query's stand-in waits (4 s at most, below the use queries'
    5 s bound) for the health query to have started, and says whether it had."""
    replayed = replay_health(tmp_path / "bin", "remap-pending")
    front = tmp_path / "front"
    front.mkdir()
    marker, seen = tmp_path / "health-asked", tmp_path / "seen"
    (front / "nvidia-smi").write_text(f"""#!/bin/sh
case "$*" in *remapped_rows.pending*) : > {marker} ;; esac
case "$*" in *--query-compute-apps*)
    i=0; while [ ! -e {marker} ] && [ $i -lt 40 ]; do sleep 0.1; i=$((i + 1)); done
    if [ -e {marker} ]; then echo saw > {seen}; else echo gave-up > {seen}; fi ;;
esac
exec {replayed}/nvidia-smi "$@"
""")
    (front / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{front}:{replayed}:{os.environ['PATH']}")
    asked = Preflight(job_id="pf-h", workdir=str(tmp_path), python="python3",
                      lease_dir=str(tmp_path / "book"), gpus=True, health=True)
    facts = HostFacts.from_json(json.loads(json.dumps(preflight(asked).to_json())))
    assert facts.gpus is not None and facts.gpus.ok
    assert sick_on(host_health(facts.gpu_health, ()).to_json()).keys() == {5}
    assert seen.read_text().strip() == "saw"
