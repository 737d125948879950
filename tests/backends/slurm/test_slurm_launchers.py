"""Programs that start their own workers, on the Slurm test cluster (issue #21): one task per
node under ``launcher: per_node`` (the field notes' ``mp.spawn`` program) and ``launcher:
torchrun`` (an unchanged torchrun script), and the notes' program unchanged in a ``ranks`` job,
which builds a world of its own on every node and must be stopped by the world check
(``monitor.py watch``). The programs are tests/backends/programs/.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.output import merged_text
from tests.support.slurmcli import OrchestrateCli
from tests.support.slurmcluster import HOST_RELEASE, SECOND_RELEASE

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

PROGRAMS = Path(__file__).resolve().parents[1] / "programs"
ENDED = {"FAILED", "COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}


def _job(ocli: OrchestrateCli, name: str, launcher: str, program: str, gpus: int,
         env: str = "") -> tuple[Path, Path]:
    out = ocli.work / f"out-{name}"
    path = ocli.write(f"{name}.yaml", f"""
        name: {name}
        backend: slurm
        inventory: inventory.yaml
        launcher: {launcher}
        resources: {{nodes: 2, gpus_per_node: {gpus}, time: "00:05:00"}}
        distributed: {{backend: gloo, timeout_s: 300}}
        restart: {{max: 0}}
        env: {{OUT: '{out}'{env}}}
        command: [python3, '{PROGRAMS / program}']
        """)
    return path, out


def _worlds(out: Path) -> dict[int, dict[str, Any]]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}


@pytest.mark.parametrize("slurm_release, launcher, program", [
    (HOST_RELEASE, "per_node", "spawn_train.py"),
    (HOST_RELEASE, "torchrun", "torchrun_train.py"),
    pytest.param(SECOND_RELEASE, "torchrun", "torchrun_train.py", marks=pytest.mark.slurm_release),
], indirect=["slurm_release"])
def test_workers_started_per_node_join_the_plans_world(ocli: OrchestrateCli, launcher: str,
                                                       program: str) -> None:
    ocli.inventory()
    path, out = _job(ocli, f"w-{launcher}".replace("_", "-"), launcher, program, gpus=2)
    status = ocli.wait(ocli.submit(path), ENDED, timeout=240)
    assert status["state"] == "COMPLETED", status
    worlds = _worlds(out)
    assert sorted(worlds) == [0, 1, 2, 3], worlds
    assert {w["world_size"] for w in worlds.values()} == {4}
    assert worlds[0]["host"] == worlds[1]["host"] != worlds[2]["host"] == worlds[3]["host"]
    assert len({w["weights"] for w in worlds.values()}) == 1
    # The workers are ranks of the job: they end as their node's process did (issue #33).
    assert {r["rank"]: r["state"] for r in status["ranks"]} == dict.fromkeys(range(4),
                                                                             "COMPLETED")


def test_the_failed_torchrun_worker_is_named_not_its_nodes_first_rank(
        ocli: OrchestrateCli) -> None:
    """As on local and SSH (issue #33): worker 3 (the second on node 2) exits 3; the job's
    reason, failure and rank table name rank 3, and its node's other rank was stopped. srun
    then stops node 1's torchrun (``SignalException ... got signal: 15``): that points
    elsewhere, and torchrun's report on node 2 explains (core/plan/outcome.py ``says``)."""
    ocli.inventory()
    path, _out = _job(ocli, "w-fail", "torchrun", "torchrun_train.py", gpus=2,
                      env=", FAIL_RANK: '3'")
    status = ocli.wait(ocli.submit(path), ENDED, timeout=240)
    assert status["state"] == "FAILED", status
    merged = merged_text(Path(status["run_dir"]))
    assert status["reason"].startswith("rank 3 on "), merged
    assert "failed with exit code 3" in status["reason"], status["reason"]
    assert status["failure"]["rank"] == 3, status["failure"]
    states = {r["rank"]: r["state"] for r in status["ranks"]}
    assert (states[2], states[3]) == ("STOPPED", "FAILED"), states
    # Node 1's workers finished their steps; srun may stop its torchrun before it exits 0.
    assert states[0] == states[1] in ("COMPLETED", "STOPPED"), states


def test_the_notes_program_unchanged_in_a_ranks_job_is_stopped(ocli: OrchestrateCli) -> None:
    ocli.inventory()
    path, out = _job(ocli, "own", "ranks", "spawn_train.py", gpus=1,
                     env=", SPAWN_MODE: notes, STEPS: 900, PAUSE_S: 0.1")
    status = ocli.wait(ocli.submit(path), ENDED, timeout=240)
    assert status["state"] == "FAILED", status
    diagnosis = status["diagnosis"]
    assert diagnosis is not None and diagnosis["kind"] == "wrong_world", status
    assert "joined a world of 1, the plan has 2" in diagnosis["summary"], diagnosis
    assert "wrong world: rank" in status["reason"], status["reason"]
    merged = merged_text(Path(status["run_dir"]))
    assert "distributed.on_wrong_world: kill" in merged, merged
    assert _worlds(out) == {}
