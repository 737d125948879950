"""Restarts on the local backend: one policy, real processes, the built-in trainer resuming.

A rank killed with SIGKILL mid-training: the job restarts once and ends where an uninterrupted
run ends, parameter for parameter (under DDP, and under FSDP from a sharded checkpoint). A job
that fails the same way every time stops after the no-progress rule. A cancel between attempts
restarts nothing. ``resume`` runs an ended job's next attempt by hand.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrate.hostside import host
from tests.support.checkpoints import differing_parameters, latest_state
from tests.support.localcli import Cli
from tests.support.output import merged_text
from tests.support.sharded import FSDP_TRAIN, exported_loads, sharded_checkpoint

pytestmark = [pytest.mark.process, pytest.mark.torch]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "digits"

DIGITS = f"""
    name: {{name}}
    resources: {{{{nodes: 1, gpus_per_node: 2}}}}
    workdir: {EXAMPLE}
    train:
      model: digits:build_model
      model_args: {{{{hidden: 64}}}}
      dataset: digits:build_dataset
      optimizer: {{{{name: adamw, lr: 3.0e-3}}}}
      epochs: 24
      batch_size: 32
      seed: 7
      checkpoint_every_steps: 5
    restart: {{{{max: 2, on: [failure], backoff_s: [0]}}}}
    """


def _wait(cli: Cli, job: str, states: set[str], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        if cli.run("status", job).returncode == 0:
            status = cli.status(job)
            if status["state"] in states or time.monotonic() > deadline:
                return status
        elif time.monotonic() > deadline:
            raise AssertionError(f"no job {job}")
        time.sleep(0.3)


def _epochs(run_dir: Path) -> list[dict[str, Any]]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [r for r in map(json.loads, lines) if r["kind"] == "epoch"]


def _kill_rank_1_after_two_epochs(cli: Cli, job: str, run_dir: Path) -> None:
    """SIGKILL the job's rank 1 once two epochs are done: training is well under way."""
    deadline = time.monotonic() + 120
    while len(_epochs(run_dir)) < 2:
        assert time.monotonic() < deadline, "training never got going"
        time.sleep(0.2)
    rank1 = next(r for r in cli.status(job)["ranks"] if r["rank"] == 1)
    os.kill(int(rank1["pid"]), signal.SIGKILL)


@pytest.mark.timeout(300)
def test_a_killed_rank_restarts_once_and_ends_where_an_uninterrupted_run_ends(cli: Cli) -> None:
    cli.write("straight.yaml", DIGITS.format(name="straight"))
    cli.write("killed.yaml", DIGITS.format(name="killed"))
    straight = cli.id("straight")
    proc = cli.run("submit", str(cli.work / "straight.yaml"), "--follow", "--job-id", straight,
                   timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr

    killed = cli.id("killed")
    cli.run("submit", str(cli.work / "killed.yaml"), "--detach", "--job-id", killed, check=True)
    run_dir = cli.work / "runs" / killed
    _kill_rank_1_after_two_epochs(cli, killed, run_dir)  # checkpoints exist by then

    final = _wait(cli, killed, {"COMPLETED", "FAILED", "CANCELLED"}, 200)
    assert final["state"] == "COMPLETED", final
    attempts = final["attempts"]
    assert [a["n"] for a in attempts] == [1, 2]
    assert "rank 1 on localhost failed with signal 9 (SIGKILL)" in attempts[0]["reason"]
    assert "restart 1 of at most 2" in attempts[0]["reason"]
    assert attempts[1]["resumed_from_step"] and attempts[1]["resumed_from_step"] > 0
    log = merged_text(run_dir)
    assert "attempt 1 ended FAILED" in log and "resuming from" in log

    a, b = latest_state(cli.work / "runs" / straight), latest_state(run_dir)
    assert a["step"] == b["step"]
    assert differing_parameters(a, b) == []
    assert _epochs(cli.work / "runs" / straight)[-1]["val_accuracy"] == \
        _epochs(run_dir)[-1]["val_accuracy"]
    assert host.job_pids(killed) == []


BREAKS = """
import os
import torch
from torch.utils.data import TensorDataset


class Breaks(torch.utils.data.Dataset):
    '''Rank 1 dies on its 40th sample, the same way at every attempt.'''

    def __init__(self):
        self.x = torch.randn(512, 8)
        self.y = torch.randint(0, 2, (512,))
        self.seen = 0

    def __len__(self):
        return 512

    def __getitem__(self, i):
        self.seen += 1
        if os.environ["RANK"] == "1" and self.seen == 40:
            os._exit(7)
        return self.x[i], self.y[i]


def build_dataset():
    return Breaks(), None


def build_model():
    return torch.nn.Linear(8, 2)
"""


@pytest.mark.timeout(240)
def test_a_job_failing_the_same_way_every_time_stops_for_want_of_progress(cli: Cli) -> None:
    cli.write("breaks.py", BREAKS)
    job = cli.write("loop.yaml", """
        name: loop
        resources: {nodes: 1, gpus_per_node: 2}
        train: {model: "breaks:build_model", dataset: "breaks:build_dataset", epochs: 3,
                batch_size: 8}
        restart: {max: 5, on: [failure], backoff_s: [0]}
        """)
    proc = cli.run("submit", str(job), "--follow", "--job-id", cli.id("loop"), timeout=220)
    assert proc.returncode == 1
    status = cli.status(cli.id("loop"))
    assert status["state"] == "FAILED"
    assert len(status["attempts"]) == 2, status["attempts"]
    assert "made no progress" in status["reason"]
    assert "rank 1 on localhost failed with exit code 7" in status["reason"]
    assert "restart 1 of at most 5" in proc.stdout  # the --follow output shows the restart


@pytest.mark.timeout(120)
def test_a_cancel_between_attempts_restarts_nothing(cli: Cli) -> None:
    job = cli.write("flaky.yaml", """
        name: flaky
        resources: {nodes: 1, gpus_per_node: 1}
        command: [bash, -c, "sleep 1; exit 3"]
        restart: {max: 3, on: [failure], backoff_s: [60]}
        """)
    cli.run("submit", str(job), "--detach", "--job-id", cli.id("flaky"), check=True)
    status = _wait(cli, cli.id("flaky"), {"RESTARTING"}, 60)
    assert status["state"] == "RESTARTING"
    assert "restart 1 of at most 3 in 60s" in status["reason"]
    proc = cli.run("cancel", cli.id("flaky"), timeout=60)
    assert proc.returncode == 0
    status = cli.status(cli.id("flaky"))
    assert status["state"] == "CANCELLED"
    assert len(status["attempts"]) == 1
    time.sleep(2)
    assert cli.status(cli.id("flaky"))["state"] == "CANCELLED"
    assert host.job_pids(cli.id("flaky")) == []


@pytest.mark.timeout(240)
def test_resume_runs_the_next_attempt_in_the_same_run_directory(cli: Cli) -> None:
    cli.write("once.yaml", DIGITS.format(name="once").replace(
        "restart: {max: 2, on: [failure], backoff_s: [0]}", "restart: {max: 0}"))
    job_id = cli.id("once")
    cli.run("submit", str(cli.work / "once.yaml"), "--detach", "--job-id", job_id, check=True)
    run_dir = cli.work / "runs" / job_id
    deadline = time.monotonic() + 120
    while len(_epochs(run_dir)) < 2:
        assert time.monotonic() < deadline, "training never got going"
        time.sleep(0.2)
    assert cli.run("cancel", job_id).returncode == 0
    assert cli.status(job_id)["state"] == "CANCELLED"
    # Edit the job file: resume plans from the job as it was submitted, not from the file now.
    (cli.work / "once.yaml").write_text("not: [a job\n")
    proc = cli.run("resume", job_id, "--follow", timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    status = cli.status(job_id)
    assert status["state"] == "COMPLETED" and status["attempt"] == 2
    assert status["attempts"][1]["resumed_from_step"] > 0
    assert _epochs(run_dir)[-1]["epoch"] == 24
    again = cli.run("resume", job_id)
    assert again.returncode == 2 and "nothing to resume" in again.stderr


@pytest.mark.timeout(300)
def test_a_killed_fsdp_rank_restarts_from_the_sharded_checkpoint_exactly(cli: Cli) -> None:
    """Under ``strategy: fsdp`` the restart resumes from a sharded checkpoint (every rank its
    shard); same world size, so the exported weights equal an uninterrupted run's exactly."""
    train = FSDP_TRAIN.replace("epochs: 1", "epochs: 6")
    for name in ("straight", "killed"):
        cli.write(f"{name}.yaml", f"name: {name}\nresources: {{nodes: 1, gpus_per_node: 2}}\n"
                  f"workdir: {EXAMPLE}\nrestart: {{max: 1, on: [failure], backoff_s: [0]}}\n"
                  + train)
    straight, killed = cli.id("fsdp-straight"), cli.id("fsdp-killed")
    proc = cli.run("submit", str(cli.work / "straight.yaml"), "--follow", "--job-id", straight,
                   timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    cli.run("submit", str(cli.work / "killed.yaml"), "--detach", "--job-id", killed, check=True)
    run_dir = cli.work / "runs" / killed
    _kill_rank_1_after_two_epochs(cli, killed, run_dir)  # sharded checkpoints exist by then

    final = _wait(cli, killed, {"COMPLETED", "FAILED", "CANCELLED"}, 200)
    assert final["state"] == "COMPLETED", final
    assert [a["n"] for a in final["attempts"]] == [1, 2]
    assert final["attempts"][1]["resumed_from_step"], final["attempts"]
    sharded_checkpoint(run_dir)
    a = exported_loads(cli.run, straight, cli.work / "straight.pt")
    b = exported_loads(cli.run, killed, cli.work / "killed.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert host.job_pids(killed) == []
