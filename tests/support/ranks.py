"""Real rank processes for the tests: started with the torchrun variables, watched, killed.

One starter for every harness that runs ranks by hand (tests/support/trainranks.py,
tests/support/checkupranks.py): each rank is a real process whose stdout and stderr
go to files (``rank<N>.out``, ``rank<N>.err``) so nothing blocks on a full pipe, and a group of
ranks can be waited for with a deadline, its logs read in one piece, and killed, stopped ranks
included, so that no process outlives the test that started it.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

#: The variables that place a rank in a job (what torchrun sets, and orchestrate's own):
#: never inherited from the test's environment.
PLACE_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "ORCHESTRATE_RUN_DIR", "ORCHESTRATE_DIST_BACKEND",
)


#: Where the stores of ranks started by the tests listen: below the ports orchestrate derives
#: for jobs (orchestrate/core/plan/ports.py, 20000-31999, what the tests' jobs take) and below
#: the kernel's ephemeral range (32768+), from which every outgoing connection on the machine
#: takes its local port. A port found by binding port 0 is an ephemeral one: in the seconds
#: before rank 0 listens on it, another test's connection could take it (EADDRINUSE, seen once
#: in a CI rehearsal beside 1,650 other tests).
TEST_PORTS = range(10000, 20000)


def free_port() -> int:
    """A TCP port of :data:`TEST_PORTS` nobody listens on right now, drawn at random so that
    two test workers seldom draw the same one."""
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.choice(TEST_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {TEST_PORTS} after 100 draws")


def torchrun_env(rank: int, local_rank: int, world: int, local_world: int, group: int,
                 port: int) -> dict[str, str]:
    """The variables torchrun gives a rank, on loopback."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(group),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }


@dataclass
class Rank:
    """One started rank: its process and its output files."""

    rank: int
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    ended: float | None = None  # time.monotonic() when it was first seen ended

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace")


def start_rank(rank: int, argv: Sequence[str], env: Mapping[str, str], folder: Path,
               cwd: Path) -> Rank:
    """Starts ``argv`` as rank ``rank``, its output in ``folder/rank<N>.out`` and ``.err``."""
    out, err = folder / f"rank{rank}.out", folder / f"rank{rank}.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(list(argv), env=dict(env), stdout=stdout, stderr=stderr, cwd=cwd)
    return Rank(rank, proc, out, err)


class RankGroup:
    """The ranks of one run: waited for together, their logs in one piece, killed together.
    A mixin: the harness's own record of a run (a dataclass) holds ``ranks``."""

    ranks: list[Rank]

    def wait_all(self, timeout: float) -> None:
        """Returns when every rank has ended (each one's ``ended`` set); kills them all and
        fails with every log past ``timeout``."""
        deadline = time.monotonic() + timeout
        while any(r.proc.poll() is None for r in self.ranks):
            self._note_ended()
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"ranks still running after {timeout} s:\n{self.logs()}")
            time.sleep(0.02)
        self._note_ended()

    def _note_ended(self) -> None:
        for r in self.ranks:
            if r.ended is None and r.proc.poll() is not None:
                r.ended = time.monotonic()

    def kill(self) -> None:
        """SIGKILL every rank still running (a stopped one is continued first) and reap it."""
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


def without_place(environ: Mapping[str, str], also: Sequence[str] = ()) -> dict[str, str]:
    """``environ`` without the variables that place a rank (and ``also``)."""
    drop = {*PLACE_VARS, *also}
    return {k: v for k, v in environ.items() if k not in drop}


class Starts(Protocol):
    """A starter of rank processes (tests/support/trainranks.py, diagranks.py, checkupranks.py)."""

    def kill_all(self) -> None: ...


StarterT = TypeVar("StarterT", bound=Starts)


def killed_at_end(starter: StarterT) -> Iterator[StarterT]:
    """The body of every starter fixture: the test gets ``starter``, and every process it started
    is killed when the test (or the module, for a module fixture) ends, whatever happened."""
    try:
        yield starter
    finally:
        starter.kill_all()
