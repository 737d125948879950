"""Programs that start their own workers, on this machine (issue #21): the field notes'
``mp.spawn`` program under ``launcher: per_node``, an unchanged torchrun script under
``launcher: torchrun``, and the notes' program brought unchanged into a ``ranks`` job, which
builds worlds of its own and must never end COMPLETED.

Real ranks (gloo on CPU) started by ``orchestrate submit``; the programs are
tests/backends/programs/ (they import nothing of orchestrate). Each worker writes the rank and
world size of the process group it formed: the test compares them with the plan.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.localcli import Cli

pytestmark = [pytest.mark.process, pytest.mark.torch]

PROGRAMS = Path(__file__).resolve().parents[1] / "programs"


def _job(cli: Cli, name: str, launcher: str, program: str, env: str = "",
         distributed: str = "{backend: gloo}") -> tuple[Path, Path]:
    out = cli.work / f"out-{name}"
    path = cli.write(f"{name}.yaml", f"""
        name: {name}
        launcher: {launcher}
        resources: {{nodes: 1, gpus_per_node: 2}}
        distributed: {distributed}
        restart: {{max: 0}}
        env: {{OUT: '{out}'{env}}}
        command: [python3, '{PROGRAMS / program}']
        """)
    return path, out


def _until_done(cli: Cli, job: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status = cli.status(job)
        if status["state"] not in ("PENDING", "RUNNING") or time.monotonic() > deadline:
            return status
        time.sleep(0.3)


def _worlds(out: Path) -> dict[int, dict[str, Any]]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}


def _joined(status: dict[str, Any]) -> list[dict[str, Any]]:
    folder = Path(status["run_dir"]) / "diag" / "joined" / "1"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


@pytest.mark.timeout(150)
def test_the_field_notes_spawn_program_joins_the_plans_world_per_node(cli: Cli) -> None:
    job = cli.id("spawn")
    path, out = _job(cli, "spawn", "per_node", "spawn_train.py")
    cli.run("submit", str(path), "--detach", "--job-id", job, check=True)
    status = _until_done(cli, job, 120)
    assert status["state"] == "COMPLETED", status
    worlds = _worlds(out)
    assert sorted(worlds) == [0, 1], worlds
    assert {w["world_size"] for w in worlds.values()} == {2}
    assert len({w["weights"] for w in worlds.values()}) == 1  # one model, trained together
    assert len({w["pid"] for w in worlds.values()}) == 2
    # Each worker was seen joining as its rank (the sidecar's record: the world check's input).
    joined = {j["rank"]: j for j in _joined(status)}
    assert sorted(joined) == [0, 1] and {j["world_size"] for j in joined.values()} == {2}
    assert {j["pid"] for j in joined.values()} == {w["pid"] for w in worlds.values()}
    assert {r["state"] for r in status["ranks"]} == {"COMPLETED"}, status["ranks"]


@pytest.mark.timeout(150)
def test_an_unchanged_torchrun_script_runs_under_launcher_torchrun(cli: Cli) -> None:
    job = cli.id("trun")
    path, out = _job(cli, "trun", "torchrun", "torchrun_train.py")
    cli.run("submit", str(path), "--detach", "--job-id", job, check=True)
    status = _until_done(cli, job, 120)
    assert status["state"] == "COMPLETED", status
    worlds = _worlds(out)
    assert sorted(worlds) == [0, 1], worlds
    assert {w["world_size"] for w in worlds.values()} == {2}
    assert [w["env_rank"] for _, w in sorted(worlds.items())] == ["0", "1"]
    assert len({w["weights"] for w in worlds.values()}) == 1
    # torchrun's workers are ranks of the job: their states follow the node's (issue #33).
    assert [(r["rank"], r["state"]) for r in status["ranks"]] == [
        (0, "COMPLETED"), (1, "COMPLETED")], status["ranks"]


@pytest.mark.timeout(150)
def test_the_notes_program_unchanged_in_a_ranks_job_is_named_and_stopped(cli: Cli) -> None:
    """Each of the 2 ranks runs the notes' mp.spawn with its own localhost world of 1: two
    separate models. The world check names it and stops the job (on_wrong_world: kill)."""
    job = cli.id("own")
    path, out = _job(cli, "own", "ranks", "spawn_train.py",
                     env=", SPAWN_MODE: notes, STEPS: 400, PAUSE_S: 0.1")
    cli.run("submit", str(path), "--detach", "--job-id", job, check=True)
    status = _until_done(cli, job, 100)
    assert status["state"] == "FAILED", status
    diagnosis = status["diagnosis"]
    assert diagnosis["kind"] == "wrong_world", diagnosis
    summary = diagnosis["summary"]
    assert "joined a world of 1, the plan has 2" in summary, summary
    assert "the program builds its own world" in summary
    assert status["reason"].startswith(f"wrong world: {summary}"), status["reason"]
    assert _worlds(out) == {}  # stopped long before its 400 steps were done
    shown = cli.run("status", job).stdout
    assert "joined a world of 1" in shown, shown


def _joined_when_both(cli: Cli, job: str, timeout: float = 90) -> dict[int, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = cli.status(job)
        if status.get("run_dir"):
            joined = {j["rank"]: j for j in _joined(status)}
            if len(joined) == 2:
                return joined
        time.sleep(0.3)
    raise AssertionError(f"the workers never joined: {cli.status(job)}")


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(150)
def test_a_killed_spawn_worker_fails_the_job_naming_it(cli: Cli) -> None:
    import os
    import signal

    job = cli.id("kill")
    path, _ = _job(cli, "kill", "per_node", "spawn_train.py", env=", STEPS: 600, PAUSE_S: 0.1")
    cli.run("submit", str(path), "--detach", "--job-id", job, check=True)
    joined = _joined_when_both(cli, job)
    os.kill(joined[1]["pid"], signal.SIGKILL)
    status = _until_done(cli, job, 60)
    assert status["state"] == "FAILED", status
    assert status["reason"].startswith("rank 1 on localhost failed with signal 9"), status
    assert not any(_alive(j["pid"]) for j in joined.values())
    states = {r["rank"]: (r["state"], r["signal"]) for r in status["ranks"]}
    assert states == {0: ("STOPPED", None), 1: ("FAILED", 9)}, status["ranks"]


@pytest.mark.timeout(150)
def test_cancel_leaves_no_spawn_worker(cli: Cli) -> None:
    job = cli.id("cxl")
    path, _ = _job(cli, "cxl", "per_node", "spawn_train.py", env=", STEPS: 600, PAUSE_S: 0.1")
    cli.run("submit", str(path), "--detach", "--job-id", job, check=True)
    joined = _joined_when_both(cli, job)
    cli.run("cancel", job, check=True)
    status = _until_done(cli, job, 60)
    assert status["state"] == "CANCELLED", status
    deadline = time.monotonic() + 15
    while any(_alive(j["pid"]) for j in joined.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(j["pid"]) for j in joined.values())
