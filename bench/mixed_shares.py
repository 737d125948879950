"""A job with one slow rank, ``batch_split: equal`` against ``measured``: epoch time and ratio.

Two ranks on the local backend train tests/support/mixedwork.py (a compute-bound MLP, global
batch 1024, SGD), rank 1 capped at half a CPU core by a cgroup (tests/support/throttle.py; the
stand-in for an A6000 beside an A100, which datasheets put at about half its speed). Under
``equal`` every step waits for the slow rank; ``measured`` times each rank's own work over the
first steps and then splits the batch so the step times are equal: ideally 2/3 of the equal
split's epoch (1 + 0.5 cores' worth of work in the time of 1). Runs alternate equal, measured,
equal, ... so that machine noise hits both; a run's figure is the median epoch time of its
epochs after the first (which holds the measuring steps); the result is the median over pairs
and the ratio measured / equal (target <= 0.8; ideal 0.667). Root only (cgroups).

    python bench/mixed_shares.py [--pairs 3] [--epochs 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support import mixedwork, throttle  # noqa: E402

SUPPORT = REPO / "tests" / "support"


def _job(folder: Path, split: str, epochs: int, cgroup: Path) -> Path:
    path = folder / f"{split}.json"
    path.write_text(json.dumps({
        "name": split, "backend": "local",
        "resources": {"nodes": 1, "gpus_per_node": 2},
        "workdir": str(SUPPORT),
        "env": {"MIXED_THROTTLE_RANK": "1", "MIXED_THROTTLE_CGROUP": str(cgroup)},
        "train": mixedwork.train_config(split, epochs=epochs)}))
    return path


def _run(folder: Path, split: str, epochs: int, cgroup: Path, n: int) -> dict[str, Any]:
    job_id = f"bench-{split}-{n}-{os.getpid()}"
    env = dict(os.environ, ORCHESTRATE_HOME=str(folder / "home"),
               ORCHESTRATE_RUNS=str(folder / "runs"), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrate", "submit", str(_job(folder, split, epochs, cgroup)),
         "--follow", "--job-id", job_id], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{split} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    epochs_ = mixedwork.epochs_of(folder / "runs" / job_id)
    return {"epoch_s": statistics.median(e["epoch_s"] for e in epochs_[1:]),
            "shares": epochs_[-1]["batch_shares"], "val_accuracy": epochs_[-1]["val_accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    why = throttle.available()
    if why is not None:
        raise SystemExit(f"cannot throttle a rank here: {why}")
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    results: dict[str, list[dict[str, Any]]] = {"equal": [], "measured": []}
    slow = throttle.Throttle(cores=0.5)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for n in range(args.pairs):
                for split in results:
                    results[split].append(_run(Path(tmp), split, args.epochs, slow.path, n))
                    got = results[split][-1]
                    print(f"pair {n + 1} {split:<9} epoch {got['epoch_s']:.3f} s  shares "
                          f"{got['shares']}  val_acc {got['val_accuracy']:.4f}", flush=True)
    finally:
        slow.close()
    medians = {split: statistics.median(r["epoch_s"] for r in runs)
               for split, runs in results.items()}
    ratio = medians["measured"] / medians["equal"]
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"equal    median epoch {medians['equal']:.3f} s")
    print(f"measured median epoch {medians['measured']:.3f} s")
    print(f"ratio measured / equal: {ratio:.3f} (target <= 0.8, ideal 0.667)")
    if args.json is not None:
        args.json.write_text(json.dumps({"medians": medians, "ratio": ratio,
                                         "runs": results}, indent=2))


if __name__ == "__main__":
    main()
