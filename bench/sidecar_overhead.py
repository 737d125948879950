"""Cost of the stall sidecar: the built-in trainer's samples/s with the sidecar on vs off.

Runs ``python -m orchestrate.train`` on the digits example (examples/digits: MLP hidden=128,
batch 32 per rank, AdamW 3e-3; 2 gloo ranks on the CPU, one intra-op thread each, checkpoint
only at the end) with ``ORCHESTRATE_SIDECAR=0`` (off) and unset (on: the trainer starts the
sidecar, which writes a heartbeat every ``--heartbeat-s`` seconds and calls ``phase()`` every
step). A run's figure is the median of its per-epoch training samples/s (from metrics.jsonl,
epochs after the first); runs alternate off, on, off, on ... so drift in the machine's load hits
both alike; the result is the ratio of the medians (target: on / off >= 0.99).

On a shared machine single runs move by +-20%, far more than the effect; so the script also
reports the cost directly, free of that noise: the CPU time the sidecar threads used (each
heartbeat carries its thread's ``cpu_s``) as a share of the run, and the time of one
``phase()`` call (the trainer makes one per step).

    python bench/sidecar_overhead.py [--repeats 7] [--epochs 100] [--heartbeat-s 2.5]
                                     [--json out.json]

``--heartbeat-s 0.2`` shows the cost when beats are 12x more frequent than the default.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"
WORLD = 2
_PLACE = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
          "MASTER_PORT", "ORCHESTRATE_SIDECAR", "ORCHESTRATE_SIDECAR_PID",
          "ORCHESTRATE_HEARTBEAT_S", "ORCHESTRATE_RUN_DIR")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(epochs: int, work: Path, *, sidecar: bool, heartbeat_s: float) -> tuple[float, float]:
    """One 2-rank run of the trainer: its median per-epoch samples/s after the first epoch, and
    (sidecar on) the share of a CPU its sidecar threads used over the run (from the last
    heartbeats' ``cpu_s``; 0 when off)."""
    from orchestrate.train.config import TrainSpec

    spec = TrainSpec(
        model="digits:build_model", model_args={"hidden": 128},
        dataset="digits:build_dataset", optimizer={"name": "adamw", "lr": 3.0e-3},  # type: ignore[arg-type]
        epochs=epochs, batch_size=32, seed=777, checkpoint_every_steps=10**9,
    )
    config = work / "config.json"
    config.write_text(json.dumps(spec.model_dump(mode="json")))
    run_dir = work / "run"
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {k: v for k, v in os.environ.items() if k not in _PLACE and not k.startswith("SLURM")}
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
            LOCAL_WORLD_SIZE=str(WORLD), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port), OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(REPO), str(DIGITS)]),
            ORCHESTRATE_HEARTBEAT_S=str(heartbeat_s),
        )
        if not sidecar:
            env["ORCHESTRATE_SIDECAR"] = "0"
        log = open(work / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
        argv = [sys.executable, "-m", "orchestrate.train", "--config", str(config),
                "--run-dir", str(run_dir)]
        procs.append((subprocess.Popen(argv, cwd=DIGITS, env=env, stdout=log, stderr=log), log))
    codes = []
    for proc, log in procs:
        codes.append(proc.wait(timeout=900))
        log.close()
    if any(codes):
        raise RuntimeError(f"ranks exited {codes}:\n{(work / 'rank0.log').read_text()[-3000:]}")
    beats = run_dir / "diag" / "hb" / "rank-0.json"
    if sidecar != beats.exists():
        raise RuntimeError(f"sidecar {'on' if sidecar else 'off'} but heartbeat file "
                           f"{'missing' if sidecar else 'present'}: {beats}")
    share = 0.0
    if sidecar:
        shares = []
        for rank in range(WORLD):
            last = json.loads((beats.parent / f"rank-{rank}.json").read_text())
            shares.append(last["cpu_s"] / (last["t"] - last["started"]))
        share = statistics.mean(shares)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in records if r["kind"] == "epoch"]
    return statistics.median(rates[1:]), share


def phase_call_ns() -> float:
    """What one ``sidecar.phase("step", n)`` call costs (the trainer makes one per step)."""
    import timeit

    from orchestrate import sidecar

    with tempfile.TemporaryDirectory(prefix="sidecar-phase-") as tmp:
        sidecar.start(tmp, 0, interval_s=3600)
        loops = 200_000
        best = min(timeit.repeat(lambda: sidecar.phase("step", 41), number=loops, repeat=5))
    return best / loops * 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="runs of each side")
    parser.add_argument("--epochs", type=int, default=100, help="epochs per run")
    parser.add_argument("--heartbeat-s", type=float, default=2.5, help="heartbeat interval")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    runs: dict[str, list[float]] = {"off": [], "on": []}
    shares: list[float] = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="sidecar-bench-") as tmp:
        for i in range(args.repeats):
            for side in ("off", "on"):
                work = Path(tmp) / f"{side}-{i}"
                work.mkdir()
                rate, share = run(
                    args.epochs, work, sidecar=side == "on", heartbeat_s=args.heartbeat_s
                )
                runs[side].append(rate)
                if side == "on":
                    shares.append(share)
                print(f"run {i + 1}/{args.repeats} sidecar {side:3s} {rate:9.0f} samples/s",
                      flush=True)
    medians = {side: statistics.median(values) for side, values in runs.items()}
    ratio = medians["on"] / medians["off"]
    load_after = os.getloadavg()[0]
    call_ns = phase_call_ns()
    result: dict[str, Any] = {
        "medians": medians, "runs": runs, "ratio": ratio, "repeats": args.repeats,
        "sidecar_cpu_share": statistics.median(shares), "phase_call_ns": call_ns,
        "epochs": args.epochs, "heartbeat_s": args.heartbeat_s, "world_size": WORLD,
        "load_average_before_after": [load_before, load_after], "cpus": os.cpu_count(),
        "command": " ".join(["python", "bench/sidecar_overhead.py", *sys.argv[1:]]),
    }
    for side, value in medians.items():
        print(f"median sidecar {side:3s} {value:9.0f} samples/s")
    print(f"ratio on / off {ratio:.3f} (target >= 0.99); heartbeat every {args.heartbeat_s} s; "
          f"load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} CPUs")
    print(f"sidecar thread CPU: {100 * statistics.median(shares):.3f} % of one core per rank "
          f"(median over runs); phase() call {call_ns:.0f} ns")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
