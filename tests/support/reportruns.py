"""Real two-rank runs of the built-in trainer for the report, status and live-view tests (the
session fixture ``pace_runs`` in tests/report/conftest.py runs them once).

The dataset factory below is written into each test's work folder (the job's workdir). Its
``__getitem__`` sleeps ``delay_s`` per item only on the rank whose ``RANK`` is 1, so that rank
waits for data in every step: a straggler made on purpose. Each run takes ~10-20 s on a busy
2-core machine (most of it two ``import torch``), so the runs are shared by the tests of a module.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.localcli import Cli

PACE_DATA = '''
"""Points in 32 dimensions labelled by a fixed random linear map (learnable, no download)."""
import os
import time

import torch
from torch import nn
from torch.utils.data import Dataset


class Points(Dataset):
    def __init__(self, x, y, delay_s):
        self.x, self.y = x, y
        self.delay_s = delay_s if os.environ.get("RANK") == "1" else 0.0

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        if self.delay_s:
            time.sleep(self.delay_s)  # the slow disk of rank 1's node
        return self.x[index], self.y[index]


def build_dataset(n_train=1024, n_val=256, dim=32, classes=4, delay_s=0.0):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(dim, classes, generator=g)
    x = torch.randn(n_train + n_val, dim, generator=g)
    y = (x @ w).argmax(1)
    return Points(x[:n_train], y[:n_train], delay_s), Points(x[n_train:], y[n_train:], 0.0)


def build_model(dim=32, hidden=256, classes=4):
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, classes))
'''

#: Seconds per item that rank 1 sleeps in the slow run: 32 ms per batch of 32.
SLOW_ITEM_S = 0.001
EPOCHS = 3
STEPS_PER_EPOCH = 16  # 1024 samples / 2 ranks / batch 32


def pace_job(cli: Cli, name: str, delay_s: float, epochs: int = EPOCHS) -> Path:
    """A train: job of the dataset above (``make_cli`` sets 0.5 s timing windows)."""
    (cli.work / "pace_data.py").write_text(PACE_DATA)
    return cli.write(f"{name}.yaml", f"""
        name: {name}
        resources: {{nodes: 1, gpus_per_node: 2}}
        distributed: {{timeout_s: 120}}
        train:
          model: pace_data:build_model
          dataset: pace_data:build_dataset
          dataset_args: {{delay_s: {delay_s}}}
          epochs: {epochs}
          batch_size: 32
          log_every_steps: 4
          optimizer: {{name: adamw, lr: 3.0e-3}}
        """)


@dataclass
class Run:
    """A finished job: its id, status document (``status --json``) and run directory."""

    job_id: str
    status: dict[str, Any]
    run_dir: Path

    def metrics(self) -> list[dict[str, Any]]:
        text = (self.run_dir / "metrics.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines()]


@dataclass
class Runs:
    cli: Cli
    slow: Run
    even: Run


def make_cli(base: Path) -> Cli:
    home, work = base / "home", base / "work"
    work.mkdir(parents=True)
    # Timing windows of 0.5 s, for a few per run: local ranks inherit the submitting
    # environment (a job file's env may not set ORCHESTRATE_ variables).
    env = dict(os.environ, ORCHESTRATE_HOME=str(home), ORCHESTRATE_RUNS=str(work / "runs"),
               ORCHESTRATE_TIMING_S="0.5")
    env.pop("ORCHESTRATE_JOB_ID", None)
    env.pop("ORCHESTRATE_TIMING", None)
    return Cli(home=home, work=work, env=env, uid=uuid.uuid4().hex[:6])


def reap_all(cli: Cli) -> None:
    """Stop whatever a test left running, through ``orchestrate cancel`` (a no-op on ended
    jobs): every process a test started ends with it."""
    runs = cli.work / "runs"
    names = [run.name for run in runs.glob("*")] if runs.exists() else []
    if names:
        cli.run("cancel", *names, timeout=60)


def run_job(cli: Cli, name: str, delay_s: float) -> Run:
    job_id = cli.id(name)
    proc = cli.run("submit", str(pace_job(cli, name, delay_s)), "--follow", "--job-id", job_id,
                   timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    status = cli.status(job_id)
    return Run(job_id, status, Path(str(status["run_dir"])))


def chromium() -> str:
    """The Chromium binary (tests/setup.sh installs it); a missing one fails the test."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "chromium is not installed: run tests/setup.sh (apt-get install chromium)"
    return found
