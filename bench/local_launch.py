"""Wall time of ``orchestrate submit --follow`` against the same two ranks started by hand.

The floor a launcher can reach: the bench itself starts both ranks of a trivial DDP program
(init_process_group gloo, one all_reduce, exit) with the torchrun variables set (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and waits for both. The
other side is a person's ``orchestrate submit job.yaml --follow`` of the same program: the CLI's
start, planning, the supervisor, the ranks, following their output to the end. Runs interleave
(orchestrate first, then by hand, then by hand first, ...) so that machine noise hits both
alike. Prints medians (min-max) and the ratio; target: orchestrate / by hand <= 1.2.

    python bench/local_launch.py [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sidebyside import TRIVIAL_DDP

JOB = """
name: trivial
resources: {nodes: 1, gpus_per_node: 2}
command: [python, prog.py]
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def by_hand(work: Path, env: dict[str, str]) -> float:
    """Both ranks started from here with the torchrun variables; until both exited."""
    start = time.perf_counter()
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "prog.py"], cwd=work, stdout=subprocess.DEVNULL,
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                     LOCAL_WORLD_SIZE="2", GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=port))
        for rank in range(2)
    ]
    codes = [proc.wait() for proc in procs]
    took = time.perf_counter() - start
    if codes != [0, 0]:
        raise SystemExit(f"ranks by hand exited {codes}")
    return took


def orchestrate(work: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "orchestrate", "submit", "job.yaml", "--follow"],
                          cwd=work, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"orchestrate failed:\n{proc.stdout}\n{proc.stderr}")
    return took


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} s ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    (work / "prog.py").write_text(TRIVIAL_DDP)
    (work / "job.yaml").write_text(JOB)
    env = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"),
               ORCHESTRATE_RUNS=str(work / "runs"), OMP_NUM_THREADS="1")
    env.pop("ORCHESTRATE_JOB_ID", None)
    # As a person runs it: compiled modules cached (.pyc), whatever this shell says.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    orchestrate(work, env)  # warm the page cache for both
    by_hand(work, env)
    ours: list[float] = []
    hand: list[float] = []
    for run in range(args.runs):
        sides = [(ours, orchestrate), (hand, by_hand)]
        for times, side in sides if run % 2 == 0 else sides[::-1]:
            times.append(side(work, env))
    ratio = statistics.median(ours) / statistics.median(hand)
    print(f"runs each: {args.runs} (interleaved); load average {os.getloadavg()[0]:.1f}")
    print(f"orchestrate submit --follow  {_spread(ours)}")
    print(f"two ranks by hand            {_spread(hand)}")
    print(f"ratio                        {ratio:.3f}  (target <= 1.2)")


if __name__ == "__main__":
    main()
