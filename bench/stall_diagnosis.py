"""Time from a stall to its diagnosis, on each backend (issue 11's benchmark).

A 2-rank job runs tests/diagnosis/programs/steps.py (a plain Python program, steps of one
all_reduce); at step 8 rank 1 stops in its data loading and writes the time into a mark file.
The job has ``distributed.stall_s`` = ``--stall-s`` and ``on_stall: kill``; the figure is
``diagnosis.at`` (when the watch had named the rank, written by the watch) minus the mark's
time. It is at least ``stall_s`` by definition: what orchestrate adds is the rest (the watch's
look interval, the dump request and its answers, the classification, and on SSH the reads over
the network). Runs alternate between backends; medians are printed, with the overhead beyond
``stall_s``.

    python bench/stall_diagnosis.py [--backends local ssh slurm] [--runs 5] [--stall-s 10]

ssh and slurm need the test hosts/cluster (tests/clusters/; brought up here if they are not
running; root only) and must run under ``flock /tmp/orchestrate-cluster-tests.lock``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from restart_time import SETUPS  # the same three backends' set-up

ROOT = Path(__file__).resolve().parents[1]
STEPS = ROOT / "tests" / "diag" / "programs" / "steps.py"


def one(backend: str, work: Path, where: str, env: dict[str, str], index: int, stall_s: float
        ) -> float:
    marks = work / f"marks-{backend}-{index}"
    marks.mkdir()
    job = work / f"{backend}-{index}.yaml"
    job.write_text(
        f"name: st-{backend}\nbackend: {backend}\n{where}\n"
        f"distributed: {{backend: gloo, stall_s: {stall_s:g}, on_stall: kill, timeout_s: 300}}\n"
        "restart: {max: 0}\n"
        f"env: {{SCENARIO: laggard, BAD_RANK: 1, TRIGGER_STEP: 8, MARKS: '{marks}'}}\n"
        f"command: [python3, '{STEPS}']\n")
    job_id = f"st-{backend}-{index}-{os.getpid()}"
    subprocess.run([sys.executable, "-m", "orchestrate", "submit", str(job), "--follow",
                    "--job-id", job_id], cwd=work, env=env, capture_output=True, text=True,
                   timeout=600, check=False)
    status = json.loads(subprocess.run(
        [sys.executable, "-m", "orchestrate", "status", job_id, "--json"], cwd=work, env=env,
        capture_output=True, text=True, timeout=60, check=True).stdout)
    diagnosis = status.get("diagnosis")
    if not diagnosis or diagnosis.get("kind") != "laggard":
        raise SystemExit(f"{job_id}: no laggard diagnosis: {status.get('state')} "
                         f"{status.get('reason')}")
    return float(diagnosis["at"]) - float((marks / "trigger").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", nargs="+", choices=sorted(SETUPS), default=["local"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--stall-s", type=float, default=10.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-stall-"))
    base = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"),
                ORCHESTRATE_RUNS=str(work / "runs"), PYTHONPATH=str(ROOT))
    setups = {b: SETUPS[b](work) for b in args.backends}
    results: dict[str, list[float]] = {b: [] for b in args.backends}
    started = time.monotonic()
    for index in range(args.runs):
        for backend in args.backends:
            where, extra = setups[backend]
            results[backend].append(one(backend, work, where, dict(base, **extra), index,
                                        args.stall_s))
    print(f"runs each: {args.runs} (interleaved), stall_s {args.stall_s:g}, load average "
          f"{os.getloadavg()[0]:.1f}, {time.monotonic() - started:.0f} s in all")
    print("| backend | stall -> diagnosis, median (min-max) | beyond stall_s |")
    print("|---|---|---|")
    for backend, samples in results.items():
        median = statistics.median(samples)
        print(f"| {backend} | {median:.1f} s ({min(samples):.1f}-{max(samples):.1f}) | "
              f"{median - args.stall_s:+.1f} s |")


if __name__ == "__main__":
    main()
