"""Launching real ranks of ``python -m orchestrate.train`` for the tests (fixtures:
tests/train/conftest.py).

Each rank is a real process with the torchrun environment (or only Slurm's), talking gloo over
loopback; stdout and stderr go to files beside the run so nothing blocks on a full pipe. Every
process a test started is killed when the test ends, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrate.core.spec.trainspec import TrainSpec
from tests.support.ranks import Rank, RankGroup, free_port, start_rank, torchrun_env, without_place

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "examples" / "digits"
TRAIN_TESTS = REPO / "tests" / "train"  # train_probe.py, importable by the ranks

for _path in (str(DIGITS), str(TRAIN_TESTS)):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def base_env() -> dict[str, str]:
    """The environment of a rank before its place in the job is added."""
    env = {k: v for k, v in without_place(os.environ).items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(DIGITS), str(TRAIN_TESTS)])
    env["OMP_NUM_THREADS"] = "1"
    env["ORCHESTRATE_TIMEOUT_S"] = "60"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def write_config(config: dict[str, Any], path: Path) -> Path:
    """Validate ``config`` like the launcher does and write it as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(TrainSpec.model_validate(config).model_dump(mode="json")))
    return path


def _metrics_lines(run_dir: Path) -> list[str]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [line for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Launch(RankGroup):
    """The ranks of one run of the entrypoint."""

    run_dir: Path
    ranks: list[Rank]
    started: float = field(default_factory=time.monotonic)
    skip_lines: int = 0  # metrics.jsonl lines written by earlier runs in the same run dir

    def wait(self, timeout: float = 90) -> list[int]:
        """Exit statuses of all ranks; kills them all and fails if they take too long."""
        self.wait_all(timeout)
        return [int(r.proc.returncode) for r in self.ranks]

    def signal(self, rank: int, sig: signal.Signals) -> None:
        self.ranks[rank].proc.send_signal(sig)

    def metrics(self) -> list[dict[str, Any]]:
        """This run's metrics records (earlier runs' lines in the same file are skipped)."""
        lines = _metrics_lines(self.run_dir)[self.skip_lines:]
        return [json.loads(line) for line in lines]

    def wait_for_metric(self, kind: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for record in self.metrics():
                if record["kind"] == kind:
                    return record
            if any(r.proc.poll() is not None for r in self.ranks):
                break
            time.sleep(0.01)
        raise AssertionError(f"no {kind!r} metrics line:\n{self.logs()}")


class Launcher:
    """Starts ranks for a test and remembers them so that none outlives it."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.launches: list[Launch] = []

    def start(
        self,
        config: dict[str, Any],
        run_dir: Path,
        *,
        nprocs: int = 2,
        cwd: Path = DIGITS,
        slurm: bool = False,
        env: dict[str, str] | None = None,
        prefix: dict[int, list[str]] | None = None,
    ) -> Launch:
        """Start ``nprocs`` ranks; ``prefix`` puts a command before a rank's (e.g. its own
        mount namespace)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path = write_config(config, run_dir.parent / f"{run_dir.name}.config.json")
        skip_lines = len(_metrics_lines(run_dir))
        port = free_port()
        ranks = []
        for rank in range(nprocs):
            rank_env = base_env()
            if slurm:
                rank_env.update(
                    SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS=str(nprocs),
                    SLURM_TASKS_PER_NODE=f"{nprocs}", SLURM_NODEID="0",
                    SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="4242",
                    MASTER_PORT=str(port),
                )
            else:
                rank_env.update(torchrun_env(rank, rank, nprocs, nprocs, 0, port))
            rank_env.update(env or {})
            argv = [sys.executable, "-m", "orchestrate.train", "--config", str(config_path),
                    "--run-dir", str(run_dir)]
            ranks.append(start_rank(rank, [*(prefix or {}).get(rank, []), *argv], rank_env,
                                    run_dir, cwd))
        launch = Launch(run_dir, ranks, skip_lines=skip_lines)
        self.launches.append(launch)
        return launch

    def run(self, config: dict[str, Any], run_dir: Path, *, timeout: float = 90,
            **kwargs: Any) -> Launch:
        """Start and wait; fails with all logs unless every rank exits 0."""
        launch = self.start(config, run_dir, **kwargs)
        codes = launch.wait(timeout)
        assert codes == [0] * len(codes), f"exit statuses {codes}\n{launch.logs()}"
        return launch

    def kill_all(self) -> None:
        for launch in self.launches:
            launch.kill()



def digits_config(**overrides: Any) -> dict[str, Any]:
    """The example job's ``train:`` section, with overrides."""
    config: dict[str, Any] = {
        "model": "digits:build_model",
        "model_args": {"hidden": 128},
        "dataset": "digits:build_dataset",
        "optimizer": {"name": "adamw", "lr": 3.0e-3},
        "epochs": 8,
        "batch_size": 32,
        "seed": 777,
    }
    config.update(overrides)
    return config
