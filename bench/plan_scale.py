"""How planning and rendering scale: whole `orchestrate` processes and the core in-process.

Generates inventories of N nodes x 8 GPUs, each named by one hostlist entry (``gpu[0001-N]``),
and a `command:` job that takes every node, once per backend (ssh: one launch script per node;
slurm: one sbatch). Then it times

* whole processes, as a person runs them: ``orchestrate plan --json`` and ``orchestrate render``
  for 1,024 and 4,096 nodes, median of --runs runs each (startup and imports included), next to
  ``orchestrate --help`` (startup alone);
* the core in this process, for 64 to 4,096 nodes: load + plan, and render, median of --runs,
  with the time per node, to show that both grow linearly.

Usage: python bench/plan_scale.py [--runs 5]   (prints markdown tables)
Target (docs/performance.md): the 1,024-node `plan --json` process under 1 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
GPUS_PER_NODE = 8


def write_case(folder: Path, nodes: int, backend: str) -> Path:
    """An inventory of ``nodes`` x 8 GPUs (one hostlist entry) and a job using all of them."""
    folder.mkdir(parents=True, exist_ok=True)
    width = max(4, len(str(nodes)))
    inventory = folder / f"inventory-{nodes}.yaml"
    if not inventory.exists():
        inventory.write_text(
            yaml.safe_dump(
                {
                    "name": f"scale-{nodes}",
                    "defaults": {
                        "gpu_link": "nvswitch",
                        "network": {"interface": "ib0", "fabric": "infiniband", "hca": "mlx5_0"},
                        "slurm": {"partition": "gpu", "gres_type": "h100"},
                        "cpus": 96,
                    },
                    "nodes": [
                        {
                            "name": f"gpu[{1:0{width}d}-{nodes:0{width}d}]",
                            "gpus": [{"model": "H100", "memory_gb": 80, "count": GPUS_PER_NODE}],
                        }
                    ],
                },
                sort_keys=False,
            )
        )
    job = folder / f"job-{nodes}-{backend}.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": f"scale-{nodes}",
                "inventory": inventory.name,
                "backend": backend,
                "resources": {"nodes": nodes, "gpus_per_node": GPUS_PER_NODE},
                "command": ["python", "train.py", "--config", "big.yaml"],
                "workdir": "/srv/work",
                "run_root": "/srv/jobs",
            },
            sort_keys=False,
        )
    )
    return job


def orchestrate_command() -> list[str]:
    """The console script when installed (what people run), else ``python -m orchestrate``."""
    script = shutil.which("orchestrate")
    return [script] if script else [sys.executable, "-m", "orchestrate"]


def median_seconds(action: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_processes(commands: list[list[str]], runs: int) -> list[list[float]]:
    """Seconds per run of each command, runs interleaved (so a busy moment hits all alike)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run(args: list[str]) -> float:
        start = time.perf_counter()
        subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=True,
                       env=env)
        return time.perf_counter() - start

    for args in commands:
        run(args)  # warm the page cache once
    times: list[list[float]] = [[] for _ in commands]
    for _ in range(runs):
        for i, args in enumerate(commands):
            times[i].append(run(args))
    return times


def spread(times: list[float]) -> str:
    return f"{statistics.median(times):.3f} s ({min(times):.2f}-{max(times):.2f})"


def time_in_process(job: Path, runs: int) -> tuple[float, float, int]:
    """Median seconds of load + plan, of render, and the rendered size in bytes."""
    from orchestrate.backends import get_backend
    from orchestrate.run.prepare import load

    prepared_plan = None

    def plan_only() -> None:
        nonlocal prepared_plan
        from orchestrate.core.plan.plan import make_plan

        loaded = load(job)
        prepared_plan = make_plan(loaded.job, loaded.inventory, job_id="bench-1",
                                  run_dir="/srv/jobs/bench-1", workdir="/srv/work")

    plan_s = median_seconds(plan_only, runs)
    assert prepared_plan is not None
    final_plan = prepared_plan
    backend = get_backend(final_plan.backend)
    render_s = median_seconds(lambda: backend.files(final_plan, None), runs)
    size = sum(len(text) for text in backend.files(final_plan, None).values())
    return plan_s, render_s, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per measurement (median)")
    args = parser.parse_args()
    runs = max(5, args.runs)
    cmd = orchestrate_command()

    with tempfile.TemporaryDirectory(prefix="plan-scale-") as tmp:
        folder = Path(tmp)
        cases = [(n, b, write_case(folder, n, b)) for n in (1024, 4096) for b in ("ssh", "slurm")]
        commands = [[*cmd, "--help"]]
        for _, _, job in cases:
            commands += [[*cmd, "plan", "--json", str(job)], [*cmd, "render", str(job)]]
        times = time_processes(commands, runs)
        startup = times[0]
        rows = [
            (nodes, backend, times[1 + 2 * i], times[2 + 2 * i])
            for i, (nodes, backend, _) in enumerate(cases)
        ]

        growth = []
        for nodes in (64, 256, 1024, 4096):
            for backend in ("ssh", "slurm"):
                job = write_case(folder, nodes, backend)
                plan_s, render_s, size = time_in_process(job, runs)
                growth.append((nodes, backend, plan_s, render_s, size))

    bytecode = "off" if sys.dont_write_bytecode else "on"
    print(f"whole processes ({' '.join(Path(c).name for c in cmd)}), median (min-max) of {runs} "
          f"interleaved runs; `--help` alone: {spread(startup)}; .pyc caching {bytecode}")
    print()
    print("| nodes x GPUs | backend | `plan --json` | `render` |")
    print("|---|---|---|---|")
    for nodes, backend, plan_t, render_t in rows:
        size = f"{nodes:,} x {GPUS_PER_NODE}"
        print(f"| {size} | {backend} | {spread(plan_t)} | {spread(render_t)} |")
    print()
    print(f"in-process core (load + plan, render), median of {runs} runs")
    print()
    print("| nodes | backend | load + plan | per node | render | per node | rendered |")
    print("|---|---|---|---|---|---|---|")
    for nodes, backend, plan_s, render_s, size in growth:
        print(
            f"| {nodes:,} | {backend} | {plan_s * 1e3:.1f} ms | {plan_s / nodes * 1e6:.0f} us "
            f"| {render_s * 1e3:.1f} ms | {render_s / nodes * 1e6:.0f} us | {size / 1e6:.2f} MB |"
        )
    target = statistics.median(next(r for r in rows if r[0] == 1024 and r[1] == "ssh")[2])
    print()
    print(f"target: 1,024-node `plan --json` process under 1 s: {target:.3f} s "
          f"({'met' if target < 1 else 'MISSED'})")


if __name__ == "__main__":
    main()
