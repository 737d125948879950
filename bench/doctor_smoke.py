"""Whole ``orchestrate doctor --tier smoke`` wall time on 1, 4 and 16 SSH hosts.

For each host count N it runs ``orchestrate doctor JOB --tier smoke --json`` (static, connect
and smoke: facts, the roll call, node-to-node ports, every rank joining, a barrier and a checked
all_reduce) on hosts h1..hN of ``tests/clusters/sshhosts.sh`` (brought up here if fewer are
running), one rank per host, and measures the CLI's wall time from start to exit, plus the
doctor's own phases from its document (``doctor.phases_s``: the backend's submit, the slowest
node leader's static and connect tiers, rank 0's smoke tier; the join and all_reduce as rank 0
timed them).
Runs are interleaved (host counts in turn, the order reversed every other round) so machine
noise hits all alike; medians of ``--runs``. Every run must pass (exit 0).

    flock /tmp/orchestrate-cluster-tests.lock python bench/doctor_smoke.py [--runs 3]
        [--hosts 1 4 16] [--keep-hosts]

Root only (the test hosts are network namespaces). On one machine every host's ranks share its
CPUs: 16 ranks import torch at once, so the 16-host figure is bounded by this machine's cores,
not by the doctor's fan-out (see the "rank start" column).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# bench/ (this script's folder) is on sys.path
from testbeds import ROOT, ssh_hosts_down, ssh_hosts_up, ssh_inventory


def write_job(work: Path, count: int) -> Path:
    (work / f"inv{count}.json").write_text(json.dumps(ssh_inventory(count)))
    job = work / f"job{count}.yaml"
    job.write_text(f"name: doc{count}\nbackend: ssh\ninventory: inv{count}.json\n"
                   f"resources: {{nodes: {count}, gpus_per_node: 1}}\n"
                   f"command: [python, -c, pass]\nenv: {{PYTHONPATH: \"{ROOT}\"}}\n")
    return job


def run_doctor(work: Path, env: dict[str, str], job: Path) -> dict[str, float]:
    began = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrate", "doctor", str(job), "--tier", "smoke", "--json"],
        cwd=work, env=env, capture_output=True, text=True, timeout=600,
    )
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"doctor {job.name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    doc: dict[str, Any] = json.loads(proc.stdout)
    smoke = next(c for c in doc["checks"] if c["tier"] == "smoke")
    steps = dict(part.rsplit(" ", 2)[:2] for part in (smoke["measured"] or "").split(", ")
                 if part.count(" ") >= 2)
    phases = doc["doctor"].get("phases_s") or {}
    return {"wall": wall, "launch": float(phases.get("launch", "nan")),
            "node_tiers": float(phases.get("node_tiers", "nan")),
            "rank_tiers": float(phases.get("rank_tiers", "nan")),
            "join": float(steps.get("join", "nan")),
            "all_reduce": float(steps.get("all_reduce", "nan"))}


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--keep-hosts", action="store_true", help="leave the hosts running")
    parser.add_argument("--json", type=Path, default=None, help="also write raw figures here")
    args = parser.parse_args()
    started_hosts = ssh_hosts_up(max(args.hosts))
    work = Path(tempfile.mkdtemp(prefix="bench-doctor-"))
    env = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"),
               ORCHESTRATE_RUNS=str(work / "runs"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    jobs = {n: write_job(work, n) for n in args.hosts}
    figures: dict[int, dict[str, list[float]]] = {
        n: {"wall": [], "launch": [], "node_tiers": [], "rank_tiers": [], "join": [],
            "all_reduce": []} for n in args.hosts}
    try:
        for n in args.hosts:  # warm caches, the hosts' sshd and the page cache once
            run_doctor(work, env, jobs[n])
        for rep in range(args.runs):
            order = list(args.hosts) if rep % 2 == 0 else list(reversed(args.hosts))
            for n in order:
                for key, value in run_doctor(work, env, jobs[n]).items():
                    figures[n][key].append(value)
            print(f"round {rep + 1}/{args.runs} done", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if started_hosts and not args.keep_hosts:
            ssh_hosts_down()
    print(f"| hosts | doctor --tier smoke, wall | launch (backend submit) | static+connect "
          f"(slowest leader) | smoke (rank 0) | join (rank 0 waits for all) | all_reduce |"
          f"   ({args.runs} runs, medians (min-max))")
    print("|---|---|---|---|---|---|---|")
    for n in args.hosts:
        f = figures[n]
        print(f"| {n} | {median(f['wall'])} | {median(f['launch'])} | "
              f"{median(f['node_tiers'])} | {median(f['rank_tiers'])} | {median(f['join'])} | "
              f"{median(f['all_reduce'])} |")
    first, last = min(args.hosts), max(args.hosts)
    ratio = statistics.median(figures[last]["wall"]) / statistics.median(figures[first]["wall"])
    print(f"\nwall({last}) / wall({first}) = {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
