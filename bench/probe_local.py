"""Cost of ``inventory probe`` without the transport (issue 15): per host and per controller.

The SSH benchmark (probe time for 1, 4 and 16 hosts) is the SSH fan-out plus these two parts:

- per host: ``python -S hostfacts.py`` as the transport runs it, on a replayed 8x H100 box
  (the stand-in nvidia-smi of tests/probe, a fake sysfs), without torch and with it;
- on the controller: parsing N hosts' facts, folding and writing the inventory, and merging it
  into an existing file, for N = 1, 4, 16 and 1000 (should stay a small share of the total).

    python bench/probe_local.py [--runs 5]
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrate.probe.facts import parse_facts  # noqa: E402
from orchestrate.probe.inventoryfile import ProbedNode, merge_inventory, render_inventory  # noqa: E402
from tests.support.probemachine import machine  # noqa: E402


def host_side(tmp: Path, runs: int, torch: bool) -> tuple[float, dict[str, object]]:
    args = [sys.executable, "-S", str(REPO / "orchestrate" / "hostside" / "hostfacts.py")]
    if not torch:
        args.append("--no-torch")
    times, facts = [], {}
    with machine(tmp, "h100-nvswitch"):
        for _ in range(runs):
            start = time.perf_counter()
            out = subprocess.run(args, capture_output=True, text=True, check=True,
                                 env=dict(os.environ), timeout=300).stdout
            times.append(time.perf_counter() - start)
            facts = json.loads(out)
    return statistics.median(times), facts


def controller(raw: dict[str, object], n: int, runs: int) -> tuple[float, float]:
    names = [f"gpu{i:04d}" for i in range(1, n + 1)]
    render_s, merge_s = [], []
    for _ in range(runs):
        start = time.perf_counter()
        probed = {name: ProbedNode(name, parse_facts(raw)) for name in names}
        text = render_inventory("bench", probed.values())
        render_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        merge_inventory(text, "bench.yaml", probed)
        merge_s.append(time.perf_counter() - start)
    return statistics.median(render_s), statistics.median(merge_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bare, raw = host_side(Path(tmp), args.runs, torch=False)
        with_torch, _ = host_side(Path(tmp), max(1, args.runs // 2), torch=True)
    print(f"host: python -S hostfacts.py  {bare * 1000:7.0f} ms without torch, "
          f"{with_torch * 1000:7.0f} ms with torch (median)")
    for n in (1, 4, 16, 1000):
        render, merge = controller(raw, n, args.runs)
        print(f"controller: {n:5d} host(s)  parse+write {render * 1000:8.1f} ms  "
              f"merge {merge * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
