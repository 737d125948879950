"""How long ``orchestrate report`` takes on a big run: 10,000 steps, 16 ranks (target < 1 s).

Builds a synthetic run directory shaped like a real one: plan.json (16 ranks on 2 nodes of 8
GPUs), metrics.jsonl with a step record every step, an epoch record every 500 steps and a
checkpoint every 1,000, and one timing file per rank with a window every 10 steps (1,000
windows per rank, 16,000 in all; rank 11 is a straggler). Then times the whole of
``write_report`` (read every file, compute the figures, render, write) several times and
reports the median wall time (and CPU time: on a shared machine the wall time also holds
the waits for a core).

    python bench/report_speed.py [--steps 10000] [--ranks 16] [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrate.report.runfiles import write_report  # noqa: E402


def synthetic_run(run_dir: Path, steps: int, ranks: int, window_steps: int = 10) -> None:
    """A run directory with ``steps`` logged steps and ``ranks`` ranks' timing windows."""
    per_node = 8
    nodes = [f"gpu{n:02d}" for n in range(math.ceil(ranks / per_node))]
    plan = {
        "job_id": run_dir.name, "job_name": "big", "backend": "slurm", "dist_backend": "nccl",
        "world_size": ranks, "master_addr": nodes[0], "master_port": 29500,
        "nodes": [{"name": n, "address": n, "node_rank": i, "nproc": per_node,
                   "first_rank": i * per_node, "gpu_indices": list(range(per_node)),
                   "gpu_models": ["H100-80GB"] * per_node, "cuda_visible_devices": "0-7",
                   "env": {"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5_0"}}
                  for i, n in enumerate(nodes)],
        "ranks": [{"rank": r, "local_rank": r % per_node, "node": nodes[r // per_node],
                   "node_rank": r // per_node, "gpu_index": r % per_node,
                   "gpu_model": "H100-80GB"} for r in range(ranks)],
        "env": {"WORLD_SIZE": str(ranks), "MASTER_ADDR": nodes[0], "MASTER_PORT": "29500"},
        "command": ["python", "-m", "orchestrate.train"], "secret_env": [], "warnings": [],
    }
    run_dir.mkdir(parents=True)
    (run_dir / "plan.json").write_text(json.dumps(plan))
    t0 = 1_700_000_000.0
    lines = [json.dumps({"kind": "start", "epoch": 1, "step": 1, "time": t0,
                         "world_size": ranks, "resumed_from_step": None})]
    for step in range(1, steps + 1):
        t = t0 + step * 0.25
        loss = 2.5 * math.exp(-step / 2500) + 0.1 + 0.05 * math.sin(step / 7)
        lines.append(json.dumps({"kind": "step", "epoch": step // 500 + 1, "step": step,
                                 "train_loss": loss, "val_loss": None, "val_accuracy": None,
                                 "samples_per_s": 4096.0, "epoch_s": None, "lr": 1e-3,
                                 "time": t}))
        if step % 500 == 0:
            lines.append(json.dumps({"kind": "epoch", "epoch": step // 500, "step": step,
                                     "train_loss": loss, "val_loss": loss * 1.1,
                                     "val_accuracy": 1 - loss / 3, "samples_per_s": 4096.0,
                                     "epoch_s": 125.0, "lr": 1e-3, "time": t}))
        if step % 1000 == 0:
            lines.append(json.dumps({"kind": "checkpoint", "epoch": step // 500, "step": step,
                                     "time": t + 1, "path": f"step-{step:08d}.pt"}))
    lines.append(json.dumps({"kind": "end", "outcome": "completed", "step": steps,
                             "time": t0 + steps * 0.25 + 2}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    timing = run_dir / "timing"
    timing.mkdir()
    for rank in range(ranks):
        slow = rank == 11
        rows = []
        for first in range(1, steps + 1, window_steps):
            n = min(window_steps, steps - first + 1)
            data = (0.06 if slow else 0.01) * n
            backward = (0.10 if slow else 0.15) * n
            rows.append(json.dumps({
                "t": t0 + (first + n) * 0.25, "rank": rank, "epoch": first // 500 + 1,
                "first_step": first, "last_step": first + n - 1, "steps": n, "samples": 32 * n,
                "data_s": data, "forward_s": 0.03 * n, "backward_s": backward,
                "optimizer_s": 0.01 * n, "wall_s": 0.25 * n, "clock": "cuda"}))
        (timing / f"rank-{rank}.jsonl").write_text("\n".join(rows) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="report-bench-") as tmp:
        run_dir = Path(tmp) / "big-0001"
        synthetic_run(run_dir, args.steps, args.ranks)
        job: dict[str, Any] = {"id": run_dir.name, "name": "big", "state": "COMPLETED",
                               "submitted_at": 1_699_999_990.0, "started_at": 1_699_999_995.0,
                               "first_step_at": 1_700_000_000.0,
                               "finished_at": 1_700_000_000.0 + args.steps * 0.25 + 3,
                               "ranks": []}
        times, cpu = [], []
        for _ in range(args.repeats):
            started, started_cpu = time.perf_counter(), time.process_time()
            path = write_report(run_dir, job)
            times.append(time.perf_counter() - started)
            cpu.append(time.process_time() - started_cpu)
        size = path.stat().st_size
        inputs = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file()) - size
    result = {
        "median_s": statistics.median(times), "runs_s": times,
        "median_cpu_s": statistics.median(cpu), "steps": args.steps,
        "ranks": args.ranks, "report_bytes": size, "input_bytes": inputs,
        "load_average": os.getloadavg()[0], "cpus": os.cpu_count(),
    }
    print(f"report of {args.steps} steps x {args.ranks} ranks ({inputs / 1e6:.1f} MB of "
          f"records): median {result['median_s']:.3f} s over {args.repeats} runs (target < 1 s; "
          f"CPU {result['median_cpu_s']:.3f} s); "
          f"{size / 1024:.0f} KiB of HTML; load average {result['load_average']:.1f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
