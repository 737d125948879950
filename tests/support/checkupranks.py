"""Starting real ranks of ``python -m orchestrate.doctor.checkup`` on loopback (fixtures:
tests/doctor/checkup/conftest.py).

Each rank is a real process with the environment the planner gives a rank (the torchrun
variables, GROUP_RANK, ORCHESTRATE_NODE_NAMES, ORCHESTRATE_RUN_DIR, GLOO_SOCKET_IFNAME=lo),
talking gloo over loopback. "Nodes" are groups of ranks sharing a GROUP_RANK: the rank program
cannot tell them from machines. Output goes to files, so nothing blocks on a full pipe, and
every process is killed when the test ends.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests.support.ranks import (
    PLACE_VARS,
    Rank,
    RankGroup,
    free_port,
    start_rank,
    torchrun_env,
    without_place,
)

REPO = Path(__file__).resolve().parents[2]
# The harness reads rank 0's store while rank 0 may still be importing torch: keep c10d's
# connection-retry lines out of the test output.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
_INHERITED = (*PLACE_VARS, "ORCHESTRATE_NODE_NAMES", "CUDA_VISIBLE_DEVICES")


@dataclass
class Checkup(RankGroup):
    """The ranks of one checkup."""

    run_dir: Path
    port: int
    ranks: list[Rank]
    names: list[str]
    started: float = field(default_factory=time.monotonic)

    def wait(self, timeout: float) -> dict[int, int]:
        """Exit status per started rank; kills them all and fails past ``timeout``."""
        self.wait_all(timeout)
        return {r.rank: int(r.proc.returncode) for r in self.ranks}

    def rank(self, number: int) -> Rank:
        return next(r for r in self.ranks if r.rank == number)

    def result(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.run_dir / "checkup.json").read_text())
        return data

    def wait_for_step(self, rank: int, prefix: str, timeout: float = 90) -> str:
        """Block until ``rank`` has entered a step starting with ``prefix`` (read from rank 0's
        store, as a client like any rank); returns the step."""
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        deadline = time.monotonic() + timeout
        key = f"checkup/step/{rank}"
        store = None
        while time.monotonic() < deadline:
            if any(r.proc.poll() is not None for r in self.ranks):
                break
            try:
                if store is None:
                    store = TCPStore("127.0.0.1", self.port, None, False,
                                     timeout=timedelta(seconds=2), wait_for_workers=False)
                if store.check([key]):
                    step = store.get(key).decode()
                    if step.startswith(prefix):
                        return str(step)
            except Exception:  # rank 0 not listening yet (importing torch on a busy machine)
                store = None
                time.sleep(0.05)
                continue
            time.sleep(0.005)
        raise AssertionError(f"rank {rank} never entered {prefix!r}:\n{self.logs()}")


class Starter:
    """Starts checkups for a test and remembers them so that none outlives it."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[Checkup] = []

    def start(
        self,
        layout: list[int],
        args: list[str],
        *,
        skip: tuple[int, ...] = (),
        env: dict[str, str] | None = None,
        port: int | None = None,
        name: str = "run",
    ) -> Checkup:
        """Ranks for ``layout`` (ranks per node); ``skip`` ranks are planned but not started."""
        run_dir = self.tmp_path / name
        run_dir.mkdir(parents=True, exist_ok=True)
        port = port or free_port()
        world = sum(layout)
        names = [chr(ord("a") + i) for i in range(len(layout))]
        base = without_place(os.environ, _INHERITED)
        base.update(
            PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
            ORCHESTRATE_NODE_NAMES=",".join(names), ORCHESTRATE_RUN_DIR=str(run_dir),
            GLOO_SOCKET_IFNAME="lo", CUDA_VISIBLE_DEVICES="",
        )
        ranks: list[Rank] = []
        rank = 0
        for node, count in enumerate(layout):
            for local in range(count):
                if rank not in skip:
                    rank_env = dict(base, **torchrun_env(rank, local, world, count, node, port))
                    rank_env.update(env or {})
                    ranks.append(start_rank(
                        rank, [sys.executable, "-m", "orchestrate.doctor.checkup", *args],
                        rank_env, run_dir, run_dir))
                rank += 1
        checkup = Checkup(run_dir, port, ranks, names)
        self.started.append(checkup)
        return checkup

    def kill_all(self) -> None:
        for checkup in self.started:
            checkup.kill()
