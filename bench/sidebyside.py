"""Two commands timed side by side, and the trivial DDP program the launch benchmarks run.

One place for what bench/local_submit.py, bench/container_submit.py and bench/local_launch.py
share: the program (init, one all-reduce, exit), a timed run that fails loudly, and interleaved
runs (A B A B ...) so that machine noise hits both sides alike, reported as medians and a ratio.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from pathlib import Path

#: Two gloo ranks: join, one all-reduce, leave. What any launcher's start is measured with.
TRIVIAL_DDP = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    """Wall seconds of one run of ``cmd``; a failed run stops the benchmark with its output."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}")
    return took


def compare(a: tuple[str, list[str]], b: tuple[str, list[str]], runs: int, cwd: Path,
            env: dict[str, str]) -> float:
    """Warm both (page cache), run them interleaved ``runs`` times each, print medians (min,
    max) and return the ratio of the medians, a / b."""
    timed(a[1], cwd, env)
    timed(b[1], cwd, env)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        times[0].append(timed(a[1], cwd, env))
        times[1].append(timed(b[1], cwd, env))
    print(f"runs each: {runs} (interleaved)")
    for (label, _), took in zip((a, b), times, strict=True):
        print(f"{label:<30} median {statistics.median(took):.3f} s  "
              f"(min {min(took):.3f}, max {max(took):.3f})")
    return statistics.median(times[0]) / statistics.median(times[1])
