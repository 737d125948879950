"""Where a local ``submit --follow`` spends its time around the ranks, checkouts side by side.

``bench/local_launch.py`` gives the whole against the ranks by hand; on a busy machine the ranks'
own ``import torch`` swamps it. This one times only what orchestrate adds, from
``strace -f -tt -e trace=execve,exit_group`` of each submit: from the CLI's exec to the first
rank's ``bash launch-<node>.sh``, and from the last rank's exit to the CLI's. Runs interleave the
checkouts (each put first on PYTHONPATH), medians; the trivial 2-rank DDP program of
local_launch.py. Needs strace.

    python bench/local_launch_phases.py [--runs 3] CHECKOUT [CHECKOUT ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_launch import JOB
from sidebyside import TRIVIAL_DDP


def _seconds(stamp: str) -> float:
    hours, minutes, rest = stamp.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(rest)


def phases(trace: Path) -> tuple[float, float]:
    """(CLI exec to the first rank's launch script, the last rank's exit to the CLI's exit)."""
    lines = trace.read_text().splitlines()
    cli, started = lines[0].split()[0], _seconds(lines[0].split()[1])
    ranks: dict[str, float] = {}
    exits: dict[str, float] = {}
    for line in lines:
        words = line.split()
        if 'execve("/usr/bin/bash"' in line and "/launch-" in line:
            ranks.setdefault(words[0], _seconds(words[1]))
        elif "exit_group(" in line:
            exits[words[0]] = _seconds(words[1])
    last = max(exits[pid] for pid in ranks)
    return min(ranks.values()) - started, exits[cli] - last


def one(checkout: str, work: Path, index: int) -> tuple[float, float]:
    trace = work / f"trace-{index}-{Path(checkout).name}.txt"
    env = dict(os.environ, PYTHONPATH=checkout, ORCHESTRATE_HOME=str(work / "home"),
               ORCHESTRATE_RUNS=str(work / "runs"), OMP_NUM_THREADS="1")
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as a person runs it: .pyc cached
    env.pop("ORCHESTRATE_JOB_ID", None)
    done = subprocess.run(
        ["strace", "-f", "--seccomp-bpf", "-tt", "-s", "200", "-e", "trace=execve,exit_group",
         "-o", str(trace), sys.executable, "-m", "orchestrate", "submit", "job.yaml", "--follow"],
        cwd=work, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"submit failed under {checkout}:\n{done.stderr}")
    return phases(trace)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("checkouts", nargs="+")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-phases-"))
    (work / "prog.py").write_text(TRIVIAL_DDP)
    (work / "job.yaml").write_text(JOB)
    found: dict[str, list[tuple[float, float]]] = {c: [] for c in args.checkouts}
    for checkout in args.checkouts:  # warm the page cache and the .pyc files
        one(checkout, work, -1)
    for index in range(args.runs):
        for checkout in args.checkouts:
            found[checkout].append(one(checkout, work, index))
    print(f"runs each: {args.runs} (interleaved); load average {os.getloadavg()[0]:.1f}")
    for checkout, rows in found.items():
        start = statistics.median(r[0] for r in rows)
        end = statistics.median(r[1] for r in rows)
        print(f"{checkout}: CLI exec to first rank {start:.3f} s, last rank exit to CLI exit "
              f"{end:.3f} s  (each: {', '.join(f'{a:.2f}/{b:.2f}' for a, b in rows)})")


if __name__ == "__main__":
    main()
