"""``launcher: torchrun`` against ``launcher: ranks`` for the same trivial 2 x 2 program, on the
SSH test hosts and the Slurm test cluster: submit to done.

The program (tests/backends/programs/torchrun_train.py, STEPS=1) reads the torchrun
environment, so it runs unchanged under both: ``ranks`` starts its 4 ranks itself, ``torchrun``
starts ``python -m torch.distributed.run`` once per node, which starts 2 workers. Each run is
timed from just before ``orchestrate submit --detach`` to the job's ``finished_at`` in the store
(recorded by the supervisor or the Slurm batch job when the last rank ended); the CLI polls
``status --json`` for it. Runs are interleaved (ranks, torchrun, ...) per backend; medians and
the ratio torchrun / ranks are printed.

    python bench/launcher_submit.py [--runs 5] [--backends ssh,slurm]
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
from testbeds import (
    ROOT,
    SLURM_SCRIPT,
    slurm_env,
    slurm_up,
    ssh_hosts_down,
    ssh_hosts_up,
    ssh_settings,
)

PROGRAM = ROOT / "tests" / "backends" / "programs" / "torchrun_train.py"
JOB = """\
name: bench-{launcher}
inventory: inventory.yaml
backend: {backend}
launcher: {launcher}
resources: {{nodes: 2, gpus_per_node: 2}}
distributed: {{backend: gloo}}
restart: {{max: 0}}
env: {{OUT: '{out}', STEPS: 1, PAUSE_S: 0}}
command: [python3, '{program}']
"""


def inventory(backend: str) -> dict[str, object]:
    if backend == "ssh":
        from testbeds import ssh_hosts

        return {"name": "bench", "defaults": {"python": sys.executable, "ssh": ssh_settings()},
                "nodes": [{"name": n, "address": a, "slots": 2} for n, a in ssh_hosts(2)]}
    return {"name": "bench", "defaults": {"python": sys.executable, "cpus": 4,
                                          "slurm": {"partition": "debug"}},
            "nodes": [{"name": n, "slots": 4} for n in ("n1", "n2", "n3")]}


def one(work: Path, env: dict[str, str], launcher: str, index: int) -> float:
    job_id = f"{launcher}-{index}"
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "orchestrate", "submit", f"{launcher}.yaml",
                    "--detach", "--job-id", job_id], cwd=work, env=env, check=True,
                   capture_output=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        out = subprocess.run([sys.executable, "-m", "orchestrate", "status", job_id, "--json"],
                             cwd=work, env=env, capture_output=True, text=True, check=False)
        status = json.loads(out.stdout) if out.returncode == 0 else {}
        if status.get("state") not in (None, "PENDING", "RUNNING"):
            if status["state"] != "COMPLETED":
                raise SystemExit(f"{job_id} ended {status['state']}: {status.get('reason')}")
            return float(status["finished_at"]) - t0
        time.sleep(0.2)
    raise SystemExit(f"{job_id} did not end in 300 s")


def bench(backend: str, runs: int) -> None:
    work = Path(tempfile.mkdtemp(prefix=f"bench-launcher-{backend}-"))
    (work / "inventory.yaml").write_text(json.dumps(inventory(backend)))
    for launcher in ("ranks", "torchrun"):
        (work / f"{launcher}.yaml").write_text(JOB.format(
            launcher=launcher, backend=backend, out=work / f"out-{launcher}", program=PROGRAM))
    env = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"),
               ORCHESTRATE_RUNS=str(work / "runs"))
    if backend == "slurm":
        env.update(slurm_env())
    one(work, env, "ranks", 0)  # warm the page cache for both
    one(work, env, "torchrun", 0)
    times: dict[str, list[float]] = {"ranks": [], "torchrun": []}
    for i in range(1, runs + 1):
        for launcher in ("ranks", "torchrun"):
            times[launcher].append(one(work, env, launcher, i))
    ranks, torchrun = (statistics.median(times[k]) for k in ("ranks", "torchrun"))
    print(f"{backend}: {runs} runs each, load average {os.getloadavg()[0]:.1f}: "
          f"ranks {ranks:.2f} s, torchrun {torchrun:.2f} s, ratio {torchrun / ranks:.2f}")
    for launcher, values in times.items():
        print(f"  {launcher:9s} " + " ".join(f"{v:.2f}" for v in values))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--backends", default="ssh,slurm")
    args = parser.parse_args()
    for backend in args.backends.split(","):
        if backend == "ssh":
            started = ssh_hosts_up(2)
            try:
                bench("ssh", args.runs)
            finally:
                if started:
                    ssh_hosts_down()
        else:
            was_up = subprocess.run(["bash", str(SLURM_SCRIPT), "status"], capture_output=True,
                                    check=False).returncode == 0
            slurm_up()
            try:
                bench("slurm", args.runs)
            finally:
                if not was_up:
                    subprocess.run(["bash", str(SLURM_SCRIPT), "down"], check=False,
                                   capture_output=True)


if __name__ == "__main__":
    main()
