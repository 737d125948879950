"""Cost of per-rank step timing: the built-in trainer's samples/s with it on vs off.

Runs ``python -m orchestrate.train`` on the digits example exactly as bench/train_throughput.py
does (2 gloo ranks on the CPU, one intra-op thread each, checkpoint only at the end), once with
``ORCHESTRATE_TIMING=0`` and once with timing on (the default 2 s windows, or
``--window-s``), alternating off, on, off, on... so that drift in the machine's load hits both
sides alike. A run's figure is the median samples/s of its epochs after the first; the result
is the median of each side and their ratio on / off (target >= 0.99).

The digits step is ~1-2 ms, which makes this a worst case: a real model's step is 100x
longer while the timer's cost per step (six ``perf_counter`` calls) stays the same.

    python bench/timing_overhead.py [--repeats 5] [--epochs 40] [--window-s 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _throughput_bench() -> Any:
    spec = importlib.util.spec_from_file_location("train_throughput", HERE / "train_throughput.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each side")
    parser.add_argument("--epochs", type=int, default=40, help="epochs per run")
    parser.add_argument("--window-s", type=float, default=2.0, help="timing window (seconds)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    bench = _throughput_bench()
    sides = {"timing off": "0", "timing on": "1"}
    runs: dict[str, list[float]] = {name: [] for name in sides}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="timing-bench-") as tmp:
        for i in range(args.repeats):
            for name, switch in sides.items():
                work = Path(tmp) / f"{name.replace(' ', '-')}-{i}"
                work.mkdir()
                os.environ["ORCHESTRATE_TIMING"] = switch
                os.environ["ORCHESTRATE_TIMING_S"] = str(args.window_s)
                rates = bench.run_entrypoint(args.epochs, work)
                windows = list((work / "run" / "timing").glob("rank-*.jsonl"))
                assert bool(windows) == (switch == "1"), f"{name}: timing files {windows}"
                runs[name].append(statistics.median(rates[1:]))
                print(f"run {i + 1}/{args.repeats} {name:11s} {runs[name][-1]:9.0f} samples/s",
                      flush=True)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    result = {
        "medians": medians,
        "runs": runs,
        "ratio": medians["timing on"] / medians["timing off"],
        "repeats": args.repeats,
        "epochs": args.epochs,
        "window_s": args.window_s,
        "load_average_before_after": [load_before, os.getloadavg()[0]],
        "cpus": os.cpu_count(),
    }
    for name, value in medians.items():
        print(f"median {name:11s} {value:9.0f} samples/s")
    print(f"ratio on / off {result['ratio']:.3f} (target >= 0.99); load average "
          f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
