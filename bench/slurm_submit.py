"""What ``orchestrate submit`` adds on Slurm: submit-to-start and submit-to-end against sbatch.

Both sides run the same rendered job.sbatch (2 nodes x 1 rank, each rank prints one line) on the
test cluster (tests/clusters/slurm.sh; brought up and down here if it is not up already):

- A: ``orchestrate submit job.yaml --detach`` (a fresh Python process: plan, render, write the run
  directory, sbatch, record the job);
- B: plain ``sbatch --parsable job.sbatch`` of a script ``orchestrate render`` wrote beforehand
  (untimed), from its own run directory.

Times are taken from just before the command starts to the script's own stamps in
``slurm/events.jsonl``: ``start`` (the batch script began) and ``end`` (every rank exited and
the logs were merged); ``submit`` is how long the command itself took. Runs are interleaved
(A B A B ...) so that machine noise hits both alike; medians are printed.
Target: A - B <= 0.5 s to start. ``--release 2411``: on the second test cluster, Debian 13's
Slurm 24.11 from its own root (``ORCHESTRATE_SLURM_RELEASE=2411 tests/clusters/slurm.sh``).

    python bench/slurm_submit.py [--runs 7] [--release host|2411]
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

# bench/ (this script's folder) is on sys.path
from testbeds import SLURM_SCRIPT, slurm_env

JOB = """\
name: bench
inventory: inventory.yaml
backend: slurm
resources: {{nodes: 2, gpus_per_node: 1}}
command: [{python}, -c, "print('rank up')"]
"""

INVENTORY = """\
name: bench
defaults: {{python: {python}, slurm: {{partition: debug}}}}
nodes:
  - {{name: {p}1, slots: 4}}
  - {{name: {p}2, slots: 4}}
  - {{name: {p}3, slots: 4}}
"""

#: slurm.sh's release setting -> (state dir, node name prefix)
RELEASES = {"host": (Path(os.environ.get("ORCHESTRATE_SLURM_DIR", "/tmp/orchestrate-slurm")), "n"),
            "2411": (Path("/tmp/orchestrate-slurm2411"), "m")}


def cluster_env(release: str) -> dict[str, str]:
    exported = slurm_env(RELEASES[release][0])
    env = dict(os.environ, **exported)
    if "ORCHESTRATE_SLURM_BIN" in exported:  # the release's own clients
        env["PATH"] = f"{exported['ORCHESTRATE_SLURM_BIN']}:{env['PATH']}"
    return env


def events(run_dir: Path, timeout: float = 60) -> tuple[float, float]:
    """(start, end) stamps of the first run of the job in ``run_dir``."""
    path = run_dir / "slurm" / "events.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            found = {e["event"]: e["time"] for e in map(json.loads, path.read_text().splitlines())}
            if "end" in found:
                return float(found["start"]), float(found["end"])
        time.sleep(0.05)
    raise SystemExit(f"no end stamp in {path} after {timeout}s")


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def ours(work: Path, env: dict[str, str], index: int) -> tuple[float, float, float]:
    job_id = f"ours-{index}"
    t0 = time.time()
    run([sys.executable, "-m", "orchestrate", "submit", "job.yaml", "--detach",
         "--job-id", job_id], work, env)
    took = time.time() - t0
    start, end = events(work / "runs" / job_id)
    return took, start - t0, end - t0


def plain(work: Path, env: dict[str, str], index: int) -> tuple[float, float, float]:
    job_id = f"plain-{index}"
    run_dir = work / "runs" / job_id
    run([sys.executable, "-m", "orchestrate", "render", "job.yaml", "--job-id", job_id,
         "-o", str(run_dir)], work, env)
    # job.sbatch runs only from private folders, as a backend makes them (render makes 0755).
    for folder in [run_dir, *(p for p in run_dir.rglob("*") if p.is_dir())]:
        folder.chmod(0o700)
    t0 = time.time()
    run(["sbatch", "--parsable", "job.sbatch"], run_dir, env)
    took = time.time() - t0
    start, end = events(run_dir)
    return took, start - t0, end - t0


def summary(name: str, samples: list[tuple[float, float, float]]) -> tuple[float, ...]:
    medians = tuple(statistics.median(s[i] for s in samples) for i in range(3))
    print(f"{name:32s} submit {medians[0]:.3f} s   to start {medians[1]:.3f} s   "
          f"to end {medians[2]:.3f} s")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--release", choices=sorted(RELEASES), default="host")
    args = parser.parse_args()
    script_env = dict(os.environ, ORCHESTRATE_SLURM_RELEASE=args.release,
                      ORCHESTRATE_SLURM_DIR=str(RELEASES[args.release][0]))
    was_up = subprocess.run([str(SLURM_SCRIPT), "status"], capture_output=True,
                            check=False, env=script_env).returncode == 0
    if not was_up:
        subprocess.run([str(SLURM_SCRIPT), "up"], check=True, capture_output=True,
                       env=script_env)
    try:
        work = Path(tempfile.mkdtemp(prefix="bench-slurm-"))
        (work / "inventory.yaml").write_text(
            INVENTORY.format(python=sys.executable, p=RELEASES[args.release][1]))
        (work / "job.yaml").write_text(JOB.format(python=sys.executable))
        env = dict(cluster_env(args.release), ORCHESTRATE_HOME=str(work / "home"),
                   ORCHESTRATE_RUNS=str(work / "runs"))
        ours(work, env, 0)  # warm the page cache for both
        plain(work, env, 0)
        a, b = [], []
        for i in range(1, args.runs + 1):
            a.append(ours(work, env, i))
            b.append(plain(work, env, i))
        load = os.getloadavg()[0]
        version = run(["sbatch", "--version"], work, env).strip()
        print(f"{version}: runs each: {args.runs} (interleaved), load average {load:.1f}")
        ma = summary("A orchestrate submit --detach", a)
        mb = summary("B sbatch (same script)", b)
        print(f"A - B: to start {ma[1] - mb[1]:+.3f} s, to end {ma[2] - mb[2]:+.3f} s "
              f"(target: to start <= +0.5 s)")
        print("A to start, each run: " + " ".join(f"{s[1]:.2f}" for s in a))
        print("B to start, each run: " + " ".join(f"{s[1]:.2f}" for s in b))
    finally:
        if not was_up:
            subprocess.run([str(SLURM_SCRIPT), "down"], check=False, capture_output=True,
                           env=script_env)


if __name__ == "__main__":
    main()
