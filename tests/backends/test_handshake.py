"""The records ``submit`` and a detached supervisor exchange, and the per-host table: what one
side writes, the other reads back as the same value (pure: no process, no socket)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrate.backends.handshake import Handshake, Verdict
from orchestrate.backends.hosttable import HostRow, HostTable
from orchestrate.backends.ssh.backend import Login, SSHHandshake
from orchestrate.backends.ssh.connections import Target
from orchestrate.backends.ssh.preflight import CHECKS, Judgement, host_table
from orchestrate.core.errors import Problem
from orchestrate.core.spec.job import JobSpec
from orchestrate.run.prepare import Prepared, load_spec, plan_job

pytestmark = pytest.mark.unit


def _prepared(tmp_path: Path) -> Prepared:
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(json.dumps({"name": "two", "nodes": [
        {"name": "h1", "address": "198.18.0.1", "slots": 2},
        {"name": "h2", "address": "198.18.0.2", "slots": 2}]}))
    job = JobSpec.model_validate({"name": "hs", "backend": "ssh", "inventory": str(inventory),
                                  "resources": {"nodes": 2, "gpus_per_node": 2},
                                  "command": ["python", "train.py"], "secret_env": ["TOKEN"]})
    return plan_job(load_spec(job, tmp_path, "hs.yaml", ()), "hs-1")


def _wire(data: dict[str, Any]) -> dict[str, Any]:
    """Through the pipe: JSON text and back."""
    result: dict[str, Any] = json.loads(json.dumps(data))
    return result


def test_the_handshake_carries_the_job_as_loaded_and_planned(tmp_path: Path) -> None:
    prepared = _prepared(tmp_path)
    sent = Handshake(job_id="hs-1", source="hs.yaml", submitted_at=12.5, attempt=None,
                     plan=prepared.plan, loaded=prepared.loaded.to_json())
    got = Handshake.from_json(_wire(sent.to_json()))
    assert got == sent
    assert got.plan == prepared.plan and got.plan.secret_env == ("TOKEN",)
    assert got.loaded_job().to_json() == prepared.loaded.to_json()
    assert "TOKEN=" not in json.dumps(sent.to_json())  # the names of secrets, never values


def test_a_job_with_a_global_batch_comes_through_as_written(tmp_path: Path) -> None:
    """The supervisor reads the job back from the handshake; a dumped default ``batch_size``
    beside ``global_batch_size`` once made every such submit fail as "not both"."""
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(json.dumps({"name": "one", "nodes": [
        {"name": "h1", "address": "198.18.0.1", "slots": 2}]}))
    job = JobSpec.model_validate({"name": "gb", "backend": "ssh", "inventory": str(inventory),
                                  "resources": {"nodes": 1, "gpus_per_node": 2},
                                  "train": {"model": "m:f", "dataset": "d:f",
                                            "global_batch_size": 96,
                                            "batch_split": "measured"}})
    loaded = load_spec(job, tmp_path, "gb.yaml", ())
    back = Handshake(job_id="gb-1", source="gb.yaml", submitted_at=1.0, attempt=None,
                     plan=plan_job(loaded, "gb-1").plan, loaded=loaded.to_json())
    again = Handshake.from_json(_wire(back.to_json())).loaded_job()
    assert again.job.train is not None and again.job.train.global_batch_size == 96
    assert again.job == loaded.job
    assert plan_job(again, "gb-1").plan == back.plan  # what the supervisor does with it


def test_the_ssh_handshake_names_the_hosts_to_log_into_first(tmp_path: Path) -> None:
    prepared = _prepared(tmp_path)
    hosts = (Login(Target("h1", "198.18.0.1", "python3", user="u", port=2222), 2),
             Login(Target("h2", "198.18.0.2", "python3"), 2))
    sent = SSHHandshake(job_id="hs-1", source="hs.yaml", submitted_at=1.0, attempt=3,
                        plan=prepared.plan, loaded=prepared.loaded.to_json(), hosts=hosts)
    got = SSHHandshake.from_json(_wire(sent.to_json()))
    assert got == sent and isinstance(got, SSHHandshake)
    assert got.attempt == 3 and got.hosts[0].target.port == 2222


def test_a_refusal_comes_back_with_its_problems_and_table() -> None:
    table = HostTable("preflight", ("ssh", "workdir"), (
        HostRow("h1", ("ok", "ok")),
        HostRow("h2 (198.18.0.2)", ("ok", "/w does not exist"), frozenset({"workdir"}))))
    sent = Verdict(ok=False, problems=(Problem("h2: workdir: /w does not exist", source="j.yaml",
                                               field="preflight", hint="create it"),),
                   table=table, timings={"preflight_s": 0.25})
    got = Verdict.from_json(_wire(sent.to_json()))
    assert got == sent
    assert Verdict.from_json(_wire(Verdict(ok=True).to_json())) == Verdict(ok=True)


def test_the_preflight_table_marks_what_failed_and_can_show_only_that() -> None:
    from rich.console import Console

    h1, h2 = Target("h1", "h1", "python3"), Target("h2", "198.18.0.2", "python3")
    judged = Judgement(
        cells={"h1": dict.fromkeys(CHECKS, "ok"),
               "h2": {**dict.fromkeys(CHECKS, "-"), "ssh": "refused: host key changed"}},
        failures=[(h2, "host key", "refused: host key changed")])
    table = host_table(judged, {"h1": h1, "h2": h2})
    assert [r.label for r in table.rows] == ["h1", "h2 (198.18.0.2)"]
    assert table.rows[1].failed == frozenset({"ssh"})  # a check without a column fails "ssh"
    console = Console(width=200, record=True)
    console.print(table.render(only_failed=True))
    shown = console.export_text()
    assert "preflight: what failed (1 other host(s) passed)" in shown
    assert "h2 (198.18.0.2)" in shown and "refused: host key changed" in shown
    assert "\nh1 " not in shown and "│ h1 " not in shown
