"""The CLI's start: ``orchestrate --help`` and ``orchestrate status JOB`` as whole processes.

Side by side with the floor every command shares, ``python -c "import click, pydantic, yaml"``
(the CLI's own dependencies, imported bare), runs interleaved and rotated so that machine noise
hits every side alike; medians (min-max) and the ratios. Targets: ``--help`` within 1.6x the
floor, ``status JOB`` of a finished job under 0.3 s on a quiet machine.

    python bench/cli_start.py [--runs 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = """
name: quick
resources: {nodes: 1, gpus_per_node: 1}
command: [bash, -c, "echo hi"]
"""


def timed(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{argv} failed:\n{proc.stdout}\n{proc.stderr}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    (work / "job.yaml").write_text(JOB)
    env = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"),
               ORCHESTRATE_RUNS=str(work / "runs"))
    env.pop("ORCHESTRATE_JOB_ID", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as a person runs it: .pyc cached
    cli = [sys.executable, "-m", "orchestrate"]
    timed([*cli, "submit", "job.yaml", "--follow", "--job-id", "quick-1"], work, env)
    sides = {
        "import click, pydantic, yaml": [sys.executable, "-c", "import click, pydantic, yaml"],
        "orchestrate --help": [*cli, "--help"],
        "orchestrate status JOB": [*cli, "status", "quick-1"],
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    for argv in sides.values():  # warm the page cache (and write the .pyc files)
        timed(argv, work, env)
    names = list(sides)
    for run in range(args.runs):
        for name in names[run % len(names):] + names[:run % len(names)]:
            times[name].append(timed(sides[name], work, env))
    floor = statistics.median(times[names[0]])
    print(f"runs each: {args.runs} (interleaved); load average {os.getloadavg()[0]:.1f}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:30} {median:.3f} s ({min(values):.3f}-{max(values):.3f})  "
              f"x{median / floor:.2f} the floor")


if __name__ == "__main__":
    main()
