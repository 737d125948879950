"""How fast a restart is: from a rank's death to all ranks running again, against a fresh submit.

Issue 13's benchmark. One job, 2 ranks, ``restart: {max: 1, on: [failure], backoff_s: [0]}``:
every rank prints ``bench-start <time.time()>`` as its first line; on the first attempt rank 1
prints ``bench-death <time.time()>`` and exits 3. Both lines reach the controller's rank logs on
every backend (local files, the SSH channels, Slurm's shared run directory), so:

- restart = (the last rank's start in attempt 2) - (rank 1's death in attempt 1);
- fresh = (the last rank's start in attempt 1) - (the moment ``orchestrate submit`` was run).

Both include the interpreter's start on the ranks, so the ratio restart / fresh compares what
orchestrate does around it: noticing the death, stopping the other rank, recording, deciding,
re-planning and launching (local; SSH over the attempt's kept connections), or on Slurm a
new srun step in the same allocation (the batch script judges the ranks and runs again: no
``scontrol requeue``, no queue; issue #37) against planning, rendering, submitting and
launching. Runs alternate between backends' jobs; medians are printed.

    python bench/restart_time.py [--backends local ssh slurm] [--runs 5]

ssh and slurm need the test hosts/cluster (tests/clusters/; brought up here if they are not
running; root only) and must run under ``flock /tmp/ssh-tests.lock`` or
``flock /tmp/slurm-tests.lock``, the locks their tests take.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench/ (this script's folder) is on sys.path
from testbeds import ROOT, slurm_env, slurm_up, ssh_hosts_up, ssh_inventory

PROGRAM = """\
import os, sys, time
print("bench-start", time.time(), flush=True)
if os.environ.get("ORCHESTRATE_ATTEMPT", "1") == "1" and os.environ["RANK"] == "1":
    time.sleep(1.0)
    print("bench-death", time.time(), flush=True)
    sys.exit(3)
"""

STAMP = re.compile(r"bench-(start|death) (\d+\.\d+)")


def ssh_setup(work: Path) -> tuple[str, dict[str, str]]:
    ssh_hosts_up(2)
    (work / "inv-ssh.json").write_text(json.dumps(ssh_inventory(2)))
    return "inventory: inv-ssh.json\nresources: {nodes: 2, gpus_per_node: 1}", {}


def slurm_setup(work: Path) -> tuple[str, dict[str, str]]:
    slurm_up()
    env = slurm_env()
    (work / "inv-slurm.yaml").write_text(
        f"name: bench\ndefaults: {{python: {sys.executable}, slurm: {{partition: debug}}}}\n"
        "nodes:\n  - {name: n1, slots: 4}\n  - {name: n2, slots: 4}\n")
    return "inventory: inv-slurm.yaml\nresources: {nodes: 2, gpus_per_node: 1}", env


def local_setup(work: Path) -> tuple[str, dict[str, str]]:
    return "resources: {nodes: 1, gpus_per_node: 2}", {}


SETUPS = {"local": local_setup, "ssh": ssh_setup, "slurm": slurm_setup}


def stamps(run_dir: Path) -> tuple[list[float], float | None, list[float]]:
    """Starts of attempt 1, rank 1's death, starts of attempt 2 (from the rank logs)."""
    first: list[float] = []
    second: list[float] = []
    death = None
    for log in sorted((run_dir / "logs").glob("rank-*.log")):
        starts = []
        for kind, value in STAMP.findall(log.read_text(errors="replace")):
            if kind == "death":
                death = float(value)
            else:
                starts.append(float(value))
        if starts:
            first.append(starts[0])
        if len(starts) > 1:
            second.append(starts[1])
    return first, death, second


def one(backend: str, work: Path, where: str, env: dict[str, str], index: int
        ) -> tuple[float, float]:
    job = work / f"{backend}.yaml"
    job.write_text(f"name: rs-{backend}\nbackend: {backend}\n{where}\n"
                   "distributed: {backend: gloo}\n"
                   "restart: {max: 1, on: [failure], backoff_s: [0]}\n"
                   f"command: [{sys.executable}, {work / 'prog.py'}]\n")
    job_id = f"rs-{backend}-{index}"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "orchestrate", "submit", str(job), "--follow",
                           "--job-id", job_id], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{job_id} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    run_dir = Path(env["ORCHESTRATE_RUNS"]) / job_id
    first, death, second = [], None, []
    deadline = time.monotonic() + 30  # Slurm's logs may land a moment after the job ends
    while time.monotonic() < deadline:
        first, death, second = stamps(run_dir)
        if len(first) == 2 and len(second) == 2 and death is not None:
            break
        time.sleep(0.2)
    if len(first) != 2 or len(second) != 2 or death is None:
        raise SystemExit(f"{job_id}: stamps missing in {run_dir}/logs")
    return max(second) - death, max(first) - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", nargs="+", choices=sorted(SETUPS), default=["local"])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    (work / "prog.py").write_text(PROGRAM)
    base = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"),
                ORCHESTRATE_RUNS=str(work / "runs"), PYTHONPATH=str(ROOT))
    setups = {b: SETUPS[b](work) for b in args.backends}
    results: dict[str, list[tuple[float, float]]] = {b: [] for b in args.backends}
    for index in range(args.runs):
        for backend in args.backends:
            where, extra = setups[backend]
            results[backend].append(one(backend, work, where, dict(base, **extra), index))
    print(f"runs each: {args.runs} (interleaved), load average {os.getloadavg()[0]:.1f}")
    print("| backend | death -> all ranks running again | submit -> all ranks running | ratio |")
    print("|---|---|---|---|")
    for backend, samples in results.items():
        restart = statistics.median(s[0] for s in samples)
        fresh = statistics.median(s[1] for s in samples)
        spread = (f"{min(s[0] for s in samples):.2f}-{max(s[0] for s in samples):.2f}",
                  f"{min(s[1] for s in samples):.2f}-{max(s[1] for s in samples):.2f}")
        print(f"| {backend} | {restart:.2f} s ({spread[0]}) | {fresh:.2f} s ({spread[1]}) | "
              f"**{restart / fresh:.2f}** |")


if __name__ == "__main__":
    main()
