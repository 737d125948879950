"""Wall time of ``orchestrate submit --follow`` against ``torchrun --standalone`` (issue 4).

Both run the same trivial 2-rank DDP program (init, one all-reduce, exit) on this machine; runs
are interleaved (A B A B ...) so that machine noise hits both alike. Prints medians and the
ratio; target: orchestrate / torchrun <= 1.10.

    python bench/local_submit.py [--runs 7]
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

PROGRAM = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""

JOB = """
name: trivial
resources: {nodes: 1, gpus_per_node: 2}
command: [python, prog.py]
"""


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-local-"))
    (work / "prog.py").write_text(PROGRAM)
    (work / "job.yaml").write_text(JOB)
    env = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"), ORCHESTRATE_RUNS=str(work / "runs"),
               OMP_NUM_THREADS="1")
    ours = [sys.executable, "-m", "orchestrate", "submit", "job.yaml", "--follow"]
    theirs = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", "2", "prog.py"]
    timed(ours, work, env)  # warm the page cache for both
    timed(theirs, work, env)
    a, b = [], []
    for _ in range(args.runs):
        a.append(timed(ours, work, env))
        b.append(timed(theirs, work, env))
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"runs each: {args.runs} (interleaved)")
    print(f"orchestrate submit --follow   median {ma:.3f} s  (min {min(a):.3f}, max {max(a):.3f})")
    print(f"torchrun --standalone         median {mb:.3f} s  (min {min(b):.3f}, max {max(b):.3f})")
    print(f"ratio orchestrate/torchrun    {ma / mb:.3f}  (target <= 1.10)")


if __name__ == "__main__":
    main()
