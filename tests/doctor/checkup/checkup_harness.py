"""Starting real ranks of ``python -m orchestrate.doctor.checkup`` on loopback (fixtures:
conftest.py).

Each rank is a real process with the environment the planner gives a rank (the torchrun
variables, GROUP_RANK, ORCHESTRATE_NODE_NAMES, ORCHESTRATE_RUN_DIR, GLOO_SOCKET_IFNAME=lo),
talking gloo over loopback. "Nodes" are groups of ranks sharing a GROUP_RANK: the rank program
cannot tell them from machines. Output goes to files, so nothing blocks on a full pipe, and
every process is killed when the test ends.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
# The harness reads rank 0's store while rank 0 may still be importing torch: keep c10d's
# connection-retry lines out of the test output.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
_INHERITED = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "ORCHESTRATE_RUN_DIR", "ORCHESTRATE_DIST_BACKEND", "ORCHESTRATE_NODE_NAMES",
    "CUDA_VISIBLE_DEVICES",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    ended: float | None = None

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace")


@dataclass
class Checkup:
    """The ranks of one checkup."""

    run_dir: Path
    port: int
    ranks: list[Rank]
    names: list[str]
    started: float = field(default_factory=time.monotonic)

    def wait(self, timeout: float) -> dict[int, int]:
        """Exit status per started rank; kills them all and fails past ``timeout``."""
        deadline = time.monotonic() + timeout
        while any(r.proc.poll() is None for r in self.ranks):
            for r in self.ranks:
                if r.ended is None and r.proc.poll() is not None:
                    r.ended = time.monotonic()
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"ranks still running after {timeout} s:\n{self.logs()}")
            time.sleep(0.02)
        for r in self.ranks:
            if r.ended is None:
                r.ended = time.monotonic()
        return {r.rank: int(r.proc.returncode) for r in self.ranks}

    def rank(self, number: int) -> Rank:
        return next(r for r in self.ranks if r.rank == number)

    def kill(self) -> None:
        for r in self.ranks:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGCONT)
                r.proc.kill()
                r.proc.wait()

    def logs(self) -> str:
        return "\n".join(
            f"--- rank {r.rank} (exit {r.proc.poll()}) stdout:\n{r.stdout}\n"
            f"--- rank {r.rank} stderr:\n{r.stderr}" for r in self.ranks
        )

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
        base = {k: v for k, v in os.environ.items() if k not in _INHERITED}
        base.update(
            PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
            ORCHESTRATE_NODE_NAMES=",".join(names), ORCHESTRATE_RUN_DIR=str(run_dir),
            GLOO_SOCKET_IFNAME="lo", CUDA_VISIBLE_DEVICES="",
        )
        ranks: list[Rank] = []
        rank = 0
        for node, count in enumerate(layout):
            for local in range(count):
                if rank not in skip:
                    rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(local),
                                    LOCAL_WORLD_SIZE=str(count), GROUP_RANK=str(node))
                    rank_env.update(env or {})
                    out, err = run_dir / f"rank{rank}.out", run_dir / f"rank{rank}.err"
                    with open(out, "wb") as stdout, open(err, "wb") as stderr:
                        proc = subprocess.Popen(
                            [sys.executable, "-m", "orchestrate.doctor.checkup", *args],
                            env=rank_env, stdout=stdout, stderr=stderr, cwd=run_dir,
                        )
                    ranks.append(Rank(rank, proc, out, err))
                rank += 1
        checkup = Checkup(run_dir, port, ranks, names)
        self.started.append(checkup)
        return checkup

    def kill_all(self) -> None:
        for checkup in self.started:
            checkup.kill()
