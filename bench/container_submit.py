"""Submit-to-running of a 2-rank job in a container against the same job on the host (issue 23).

Both run the same trivial 2-rank DDP program (init, one all-reduce, exit) with
``orchestrate submit --follow`` on this machine (local backend); the container side runs it in
podman with the test image (tests/support/containers.py: built here, this machine's Python
mounted read-only). Runs are interleaved (A B A B ...) so machine noise hits both alike.
Prints medians and the ratio container / host: what a container costs a job's start (creating
the node's container, ``exec`` per rank, removing it at the end).

    python bench/container_submit.py [--runs 5]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.containers import container_section

PROGRAM = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""

JOB = """
name: {name}
resources: {{nodes: 1, gpus_per_node: 2}}
command: [python, prog.py]
{extra}
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
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-container-"))
    (work / "prog.py").write_text(PROGRAM)
    (work / "host.yaml").write_text(JOB.format(name="onhost", extra=""))
    (work / "box.yaml").write_text(JOB.format(name="inbox",
                                              extra=f"container: {container_section()}"))
    env = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"), ORCHESTRATE_RUNS=str(work / "runs"),
               OMP_NUM_THREADS="1")
    host = [sys.executable, "-m", "orchestrate", "submit", "host.yaml", "--follow"]
    box = [sys.executable, "-m", "orchestrate", "submit", "box.yaml", "--follow"]
    timed(host, work, env)  # warm the page cache for both
    timed(box, work, env)
    a, b = [], []
    for _ in range(args.runs):
        a.append(timed(box, work, env))
        b.append(timed(host, work, env))
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"runs each: {args.runs} (interleaved)")
    print(f"in a container (podman)  median {ma:.3f} s  (min {min(a):.3f}, max {max(a):.3f})")
    print(f"on the host              median {mb:.3f} s  (min {min(b):.3f}, max {max(b):.3f})")
    print(f"ratio container/host     {ma / mb:.3f}")


if __name__ == "__main__":
    main()
