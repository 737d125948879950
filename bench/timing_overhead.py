"""Cost of per-rank step timing: the built-in trainer's samples/s with it on vs off.

Runs ``python -m orchestrate.train`` on the digits example exactly as bench/train_throughput.py
does (2 gloo ranks on the CPU, one intra-op thread each, checkpoint only at the end), once with
``ORCHESTRATE_TIMING=0`` and once with timing on (the default 2 s windows, or
``--window-s``), alternating in the order off, on, on, off, off, on... so that drift in the
machine's load, and whatever favours the first or second run of a pair, hits both sides alike.
A run's figure is the median samples/s of its epochs after the first; the result is the median
of each side and their ratio on / off (target >= 0.99).

The digits step is ~5 ms on a quiet machine, a worst case: a real model's step is 100x
longer while the timer's cost per step (six ``perf_counter`` calls) stays the same. On a busy
shared machine single runs move by +-30%, more than the effect measured, so the script also
measures the timer's own cost per step directly (the calls the trainer makes, 200,000
steps in a loop, best of 3, on vs off) and divides it by the median step time of the runs: that
ratio does not depend on the machine's load.

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


def timer_cost_per_step(steps: int = 200_000) -> dict[str, float]:
    """Seconds per step of the calls the trainer makes, with timing on (windows written to a
    temporary file every 2 s) and off."""
    import time

    from orchestrate.train.timing import StepTiming

    costs = {}
    with tempfile.TemporaryDirectory(prefix="timer-cost-") as tmp:
        for name, timer in (
            ("off", StepTiming.off()),
            ("on", StepTiming(Path(tmp) / "rank-0.jsonl", 0, interval_s=2.0)),
        ):
            best = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                for step in range(1, steps + 1):
                    timer.data_ready(32)
                    timer.forward_done()
                    timer.backward_done()
                    timer.step_done(step, 1)
                    timer.resume()
                best = min(best, (time.perf_counter() - started) / steps)
            costs[name] = best
    return costs


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
            order = list(sides.items())
            for name, switch in order if i % 2 == 0 else reversed(order):
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
    cost = timer_cost_per_step()
    # samples/s of 2 ranks x batch 32 -> seconds per step
    step_s = 2 * 32 / medians["timing off"]
    result = {
        "timer_cost_per_step_s": cost,
        "step_s": step_s,
        "ratio_from_cost": step_s / (step_s + cost["on"] - cost["off"]),
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
    print(f"timer cost per step {cost['on'] * 1e6:.2f} us on, {cost['off'] * 1e6:.2f} us off; "
          f"step {step_s * 1e3:.2f} ms -> ratio {result['ratio_from_cost']:.4f}")
    print(f"ratio on / off {result['ratio']:.3f} (target >= 0.99); load average "
          f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
