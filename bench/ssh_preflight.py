"""The SSH preflight's time, for checkouts side by side: ``submit --dry-run`` on 2 test hosts.

A dry run logs in to every host, runs the preflight agent there (the node's python, torch and
its version, the working directory, the interface towards the master, GPUs, leases, ports) and
prints the per-host table: what a real submit waits for before its ranks start. Each checkout
is put first on PYTHONPATH, runs interleaved, medians. Run it under the SSH tests' lock:

    flock /tmp/ssh-tests.lock python bench/ssh_preflight.py [--runs 5] CHECKOUT [CHECKOUT ...]
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

from testbeds import ssh_hosts_down, ssh_hosts_up, ssh_inventory

JOB = """
name: preflight
backend: ssh
inventory: inventory.yaml
resources: {nodes: 2, gpus_per_node: 1}
command: [python, prog.py]
"""


def one(checkout: str, work: Path) -> float:
    env = dict(os.environ, PYTHONPATH=checkout, ORCHESTRATE_HOME=str(work / "home"),
               ORCHESTRATE_RUNS=str(work / "runs"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "orchestrate", "submit", "job.yaml",
                           "--dry-run"], cwd=work, env=env, capture_output=True, text=True,
                          check=False)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"dry run failed under {checkout}:\n{done.stderr}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("checkouts", nargs="+")
    args = parser.parse_args()
    started = ssh_hosts_up(2)
    try:
        work = Path(tempfile.mkdtemp(prefix="bench-preflight-"))
        (work / "inventory.yaml").write_text(json.dumps(ssh_inventory(2)))
        (work / "job.yaml").write_text(JOB)
        (work / "prog.py").write_text("import torch\n")
        times: dict[str, list[float]] = {c: [] for c in args.checkouts}
        for checkout in args.checkouts:  # warm the page cache and the .pyc files
            one(checkout, work)
        for _ in range(args.runs):
            for checkout in args.checkouts:
                times[checkout].append(one(checkout, work))
        print(f"runs each: {args.runs} (interleaved); load average {os.getloadavg()[0]:.1f}")
        for checkout, values in times.items():
            print(f"{checkout}: median {statistics.median(values):.2f} s "
                  f"({' '.join(f'{v:.2f}' for v in values)})")
    finally:
        if started:
            ssh_hosts_down()


if __name__ == "__main__":
    main()
