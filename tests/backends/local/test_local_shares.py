"""``batch_split: measured`` on the local backend, with one rank made slow: it gets a third of a CPU
core (tests/support/throttle.py) beside a rank with a whole one, the stand-in for an A6000 beside
an A100. Under ``equal`` shares every step waits for the slow rank; ``measured`` times each
rank's own work for a few steps and moves samples to the fast rank, so an epoch takes at most
0.8x as long (ideal 1/2), and the run trains on the same global batches: the same validation
accuracy, the same parameters. A measured run whose slow rank is killed after the shares moved
restarts from its checkpoint (at the global step: a batch is one global batch whatever the
split), measures again and ends with those parameters too.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import mixedwork, throttle
from tests.support.checkpoints import differing_parameters, latest_state
from tests.support.localcli import Cli

pytestmark = [pytest.mark.process, pytest.mark.torch, pytest.mark.timing]

SUPPORT = Path(__file__).resolve().parents[2] / "support"  # mixedwork.py, the workload

JOB = """
    name: {name}
    resources: {{nodes: 1, gpus_per_node: 2}}
    workdir: {workdir}
    env: {{MIXED_THROTTLE_RANK: "1", MIXED_THROTTLE_CGROUP: "{cgroup}",
           MIXED_FAST_CGROUP: "{fast}"}}
    train: {train}
    restart: {{max: 1, on: [failure], backoff_s: [0]}}
    """


def _job(split: str, cgroups: tuple[Path, Path], name: str | None = None, **train: Any) -> str:
    """The job, its rank 1 in the capped cgroup, rank 0 in the uncapped one (both weighted)."""
    slow, fast = cgroups
    return JOB.format(name=name or split, workdir=SUPPORT, cgroup=slow, fast=fast,
                      train=json.dumps(mixedwork.train_config(split, **train)))


@pytest.mark.timeout(600)  # it may wait for the SSH test's measurement (throttle.measuring)
def test_measured_shares_train_faster_on_the_same_batches(cli: Cli) -> None:
    why = throttle.available()
    if why is not None:
        pytest.skip(why)
    with throttle.measuring():
        runs, outputs = _three_runs(cli)

    assert [e["batch_shares"] for e in mixedwork.epochs_of(runs["equal"])] == [[512, 512]] * 3
    assert "batch shares [512, 512] -> " in outputs["measured"], outputs["measured"][-3000:]
    fast, slow_share = mixedwork.check_balanced(runs["equal"], runs["measured"])
    # What a person sees: the split and the step time before and after balancing.
    job = runs["measured"].name  # its run folder is named after its job id
    said = cli.run("status", job, check=True).stdout
    assert f"batch shares by rank: {fast}, {slow_share} of 1024 since step 8 (512, 512 " \
        "before)" in said, said
    split = cli.status(job)["batch_shares"]
    assert split["step_s_after"] < split["step_s_before"], split
    # Killed and resumed: the same parameters as the straight measured run.
    assert differing_parameters(latest_state(runs["measured"]), latest_state(runs["killed"]),
                                atol=mixedwork.TOLERANCE) == []


def _three_runs(cli: Cli) -> tuple[dict[str, Path], dict[str, str]]:
    """The equal and the measured run (each followed to its end), then the measured run whose
    slow rank is killed: their run folders, and the followed runs' output."""
    slow, fast = throttle.Throttle(cores=throttle.SLOW_CORES), throttle.Throttle(cores=None)
    cgroups = (slow.path, fast.path)
    runs: dict[str, Path] = {}
    outputs: dict[str, str] = {}
    try:
        for attempt in (1, 2):
            for split in ("equal", "measured"):
                job = cli.id(split if attempt == 1 else f"{split}-again")
                cli.write(f"{split}.yaml", _job(split, cgroups))
                proc = cli.run("submit", str(cli.work / f"{split}.yaml"), "--follow",
                               "--job-id", job, timeout=200)
                assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
                runs[split], outputs[split] = cli.work / "runs" / job, proc.stdout + proc.stderr
            seen = mixedwork.timing_held(runs["equal"], runs["measured"])
            if seen is None or attempt == 2:
                break
            # Two runs' timing on a busy machine is retried once before failing: other work
            # can take CPU from the fast rank (on the same core as the slow one for a while,
            # its measuring steps included), which no CPU weight prevents.
            print(f"{seen}: both runs again")
        runs["killed"] = _killed_after_the_shares_moved(cli, slow, fast)
    finally:
        slow.close()
        fast.close()
    return runs, outputs


def _killed_after_the_shares_moved(cli: Cli, slow: throttle.Throttle,
                                   fast: throttle.Throttle) -> Path:
    """A measured run whose rank 1 is SIGKILLed a few steps after the shares moved (and after
    a checkpoint): it restarts once and completes; returns its run folder."""
    job = cli.id("killed")
    cgroups = (slow.path, fast.path)
    cli.write("killed.yaml", _job("measured", cgroups, "killed", checkpoint_every_steps=10))
    cli.run("submit", str(cli.work / "killed.yaml"), "--detach", "--job-id", job, check=True)
    run_dir = cli.work / "runs" / job
    deadline = time.monotonic() + 120
    while not _checkpointed_after_the_shares(run_dir):
        assert time.monotonic() < deadline, "the shares never moved"
        time.sleep(0.05)
    # Rank 1 is the capped cgroup's one process: found at once, where a ``status`` process
    # takes seconds to start on a busy machine, while the ranks train on to their last step.
    (rank1,) = slow.members()
    os.kill(rank1, signal.SIGKILL)
    # The restart resumes from whichever checkpoint was the last one when the rank died.
    saved = _checkpoint_steps(run_dir)
    deadline = time.monotonic() + 200
    while (status := cli.status(job))["state"] not in ("COMPLETED", "FAILED", "CANCELLED"):
        assert time.monotonic() < deadline, status
        time.sleep(1.0)
    assert status["state"] == "COMPLETED", status
    assert [a["n"] for a in status["attempts"]] == [1, 2], status["attempts"]
    resumed = status["attempts"][1]["resumed_from_step"]
    assert resumed in saved and resumed >= 10, (resumed, saved, status["attempts"])
    return run_dir


def _checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the checkpoints the run had recorded so far."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [int(r["step"]) for r in records if r["kind"] == "checkpoint"]


def _checkpointed_after_the_shares(run_dir: Path) -> bool:
    try:
        kinds = [json.loads(line)["kind"]
                 for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return False
    return "shares" in kinds and "checkpoint" in kinds[kinds.index("shares"):]
