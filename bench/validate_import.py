"""``validate`` and ``plan`` of the digits example as whole processes, with the import check of
``train.model``/``dataset``/``loss`` and without it (``ORCHESTRATE_IMPORT_CHECK=0``).

The check (orchestrate/train/importcheck.py) runs in a child process that reads the user's module
instead of importing it; this measures what that child costs a person who types the command.
Runs are interleaved and rotated so that machine noise hits every side alike; medians
(min-max). Target (issue #33): with the check, each command under 1 s on a quiet machine.

    python bench/validate_import.py [--runs 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from sidebyside import timed

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits" / "job.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-validate-"))
    env = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"),
               ORCHESTRATE_RUNS=str(work / "runs"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as a person runs it: .pyc cached
    off = dict(env, ORCHESTRATE_IMPORT_CHECK="0")
    cli = [sys.executable, "-m", "orchestrate"]
    sides = {
        "validate, with the check": ([*cli, "validate", str(EXAMPLE)], env),
        "validate, without": ([*cli, "validate", str(EXAMPLE)], off),
        "plan, with the check": ([*cli, "plan", str(EXAMPLE)], env),
        "plan, without": ([*cli, "plan", str(EXAMPLE)], off),
    }
    for argv, side_env in sides.values():  # warm the page cache (and write the .pyc files)
        timed(argv, work, side_env)
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for run in range(args.runs):
        for name in names[run % len(names):] + names[:run % len(names)]:
            times[name].append(timed(sides[name][0], work, sides[name][1]))
    print(f"runs each: {args.runs} (interleaved); load average {os.getloadavg()[0]:.1f}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:28} {median:.3f} s ({min(values):.3f}-{max(values):.3f})"
              + ("" if "without" in name or median < 1.0 else "  over the 1 s target"))


if __name__ == "__main__":
    main()
