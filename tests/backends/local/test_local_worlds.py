"""Worlds that are not the plan's never end COMPLETED, however briefly they live (issue #33,
item 7): every rank forming a world of 1 and exiting at once, and ranks that join the plan's
world and then re-initialise a world of 1 alone. Each join is recorded as
``init_process_group`` returns (orchestrate/diagnosis/joinwatch.py), and the supervisor looks
once more when the ranks have ended.

Real local 2-rank jobs (gloo on CPU); the program is tests/backends/programs/own_world.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.localcli import Cli

pytestmark = [pytest.mark.process, pytest.mark.torch]

PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "own_world.py"


def _run(cli: Cli, name: str, mode: str) -> dict[str, Any]:
    path = cli.write(f"{name}.yaml", f"""
        name: {name}
        resources: {{nodes: 1, gpus_per_node: 2}}
        distributed: {{backend: gloo}}
        restart: {{max: 0}}
        env: {{OUT: '{cli.work / name}', MODE: {mode}}}
        command: [python3, '{PROGRAM}']
        """)
    job = cli.id(name)
    cli.run("submit", str(path), "--job-id", job, check=True)
    deadline = time.monotonic() + 120
    while True:
        status = cli.status(job)
        if status["state"] not in ("PENDING", "RUNNING") or time.monotonic() > deadline:
            return status
        time.sleep(0.3)


@pytest.mark.timeout(180)
def test_ranks_that_each_train_alone_for_a_moment_end_failed_naming_them(cli: Cli) -> None:
    status = _run(cli, "alone", "alone")
    assert status["state"] == "FAILED", status
    reason = status["reason"]
    assert reason.startswith("wrong world: rank "), reason
    assert "joined a world of 1, the plan has 2 (rank " in reason, reason
    assert "formed a world of 1 too)" in reason, reason
    assert status["diagnosis"]["kind"] == "wrong_world"
    assert sorted(status["diagnosis"]["ranks"]) == [0, 1]


@pytest.mark.timeout(180)
def test_ranks_that_re_initialise_a_world_of_their_own_end_failed_naming_both_worlds(
        cli: Cli) -> None:
    status = _run(cli, "reinit", "reinit")
    assert status["state"] == "FAILED", status
    reason = status["reason"]
    assert "joined the plan's world of 2 as rank" in reason, reason
    assert "then re-initialised a world of 1 as rank 0, the plan has 2" in reason, reason
    assert sorted(status["diagnosis"]["ranks"]) == [0, 1]
