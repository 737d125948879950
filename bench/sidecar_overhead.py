"""Cost of the stall sidecar: the built-in trainer's samples/s with the sidecar on vs off.

Runs ``python -m orchestrate.train`` on the digits example (examples/digits: MLP hidden=128,
batch 32 per rank, AdamW 3e-3; 2 gloo ranks on the CPU, one intra-op thread each, checkpoint
only at the end) with ``ORCHESTRATE_SIDECAR=0`` (off) and unset (on: the trainer starts the
sidecar, which writes a heartbeat every ``--heartbeat-s`` seconds and calls ``phase()`` every
step). A run's figure is the median of its per-epoch training samples/s (from metrics.jsonl,
epochs after the first); runs alternate off, on, on, off, off, on ... so drift in the machine's
load hits both alike and neither side always goes first; the result is the ratio of the medians
(target: on / off >= 0.99).

On a shared machine single runs move by +-20%, far more than the effect; so the script also
measures in ways that cancel that noise:

- in-process A/B: one 2-rank run of a minimal DDP loop on the same data (the hand loop of
  bench/train_throughput.py) whose ranks switch their sidecar thread off and on every 6
  epochs, calling ``phase()`` every step while on; the ratio of the median per-epoch samples/s
  on and off. Same processes, same minute: drift cancels. (Its noise floor on a shared 2-CPU
  machine: an A/A run of 400 epochs read 1.017.)
- the cost itself: the CPU time the sidecar threads used (each heartbeat carries its thread's
  ``cpu_s``) as a share of the run, and the time of one ``phase()`` call.

    python bench/sidecar_overhead.py [--repeats 7] [--epochs 100] [--heartbeat-s 2.5]
                                     [--ab-epochs 120] [--json out.json]

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
AB_BLOCK = 6  # epochs in a row with the sidecar off, then on, ... (amortizes starting it)
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
    from orchestrate.core.spec.trainspec import TrainSpec

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


def _launch_ab(epochs: int, work: Path, heartbeat_s: float) -> dict[str, Any]:
    """The in-process A/B run (this file with ``--ab-worker``) on WORLD ranks."""
    port = _free_port()
    out = work / "ab.json"
    procs = []
    for rank in range(WORLD):
        env = {k: v for k, v in os.environ.items() if k not in _PLACE and not k.startswith("SLURM")}
        env.update(
            RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port), OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(REPO), str(DIGITS)]),
        )
        argv = [sys.executable, str(Path(__file__).resolve()), "--ab-worker", "--epochs",
                str(epochs), "--heartbeat-s", str(heartbeat_s), "--out", str(out)]
        log = open(work / f"ab{rank}.log", "wb")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(argv, cwd=DIGITS, env=env, stdout=log, stderr=log), log))
    codes = []
    for proc, log in procs:
        codes.append(proc.wait(timeout=900))
        log.close()
    if any(codes) or not out.exists():
        raise RuntimeError(f"A/B ranks exited {codes}:\n{(work / 'ab0.log').read_text()[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def ab_worker(epochs: int, heartbeat_s: float, out: Path) -> None:
    """One rank of the in-process A/B: blocks of AB_BLOCK epochs alternate sidecar off, on."""
    import threading
    import time

    import digits
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from orchestrate.diagnosis import sidecar

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(777)
    train, _ = digits.build_dataset()
    model = DistributedDataParallel(digits.build_model(hidden=128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3.0e-3)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, seed=777)
    loader = DataLoader(train, batch_size=32, sampler=sampler)
    with tempfile.TemporaryDirectory(prefix="sidecar-ab-") as run_dir:
        car = sidecar.start(run_dir, rank, interval_s=heartbeat_s)
        rates: dict[str, list[float]] = {"on": [], "off": []}
        step = 0
        for epoch in range(epochs):
            on = (epoch // AB_BLOCK) % 2 == 1
            if on and (car.thread is None or not car.thread.is_alive()):
                car.stopped = False
                car.thread = threading.Thread(target=car._run, daemon=True)
                car.thread.start()
            elif not on and car.thread is not None and car.thread.is_alive():
                car.stopped = True
                car.thread.join()
            dist.barrier()
            sampler.set_epoch(epoch)
            started = time.perf_counter()
            for inputs, target in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(inputs), target).backward()
                optimizer.step()
                step += 1
                if on:
                    sidecar.phase("step", step)
            rate = len(sampler) * world / (time.perf_counter() - started)
            if epoch >= AB_BLOCK:  # warm-up
                rates["on" if on else "off"].append(rate)
        car.stopped = True
    if rank == 0:
        on_rate, off_rate = statistics.median(rates["on"]), statistics.median(rates["off"])
        out.write_text(json.dumps({"on": on_rate, "off": off_rate, "ratio": on_rate / off_rate,
                                   "epochs_each": len(rates["on"])}))
    dist.barrier()
    dist.destroy_process_group()


def phase_call_ns() -> float:
    """What one ``sidecar.phase("step", n)`` call costs (the trainer makes one per step)."""
    import timeit

    from orchestrate.diagnosis import sidecar

    with tempfile.TemporaryDirectory(prefix="sidecar-phase-") as tmp:
        sidecar.start(tmp, 0, interval_s=3600)
        loops = 200_000
        best = min(timeit.repeat(lambda: sidecar.phase("step", 41), number=loops, repeat=5))
    return best / loops * 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="runs of each side (0: none)")
    parser.add_argument("--epochs", type=int, default=100, help="epochs per run")
    parser.add_argument("--heartbeat-s", type=float, default=2.5, help="heartbeat interval")
    parser.add_argument("--ab-epochs", type=int, default=120,
                        help="epochs of the in-process A/B run (0: skip it)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--ab-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ab_worker:
        ab_worker(args.epochs, args.heartbeat_s, args.out)
        return 0
    runs: dict[str, list[float]] = {"off": [], "on": []}
    shares: list[float] = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="sidecar-bench-") as tmp:
        for i in range(args.repeats):
            # off on, on off, off on ...: neither side always runs first (drift, caches)
            for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
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
        ab = None
        if args.ab_epochs:
            work = Path(tmp) / "ab"
            work.mkdir()
            ab = _launch_ab(args.ab_epochs, work, args.heartbeat_s)
            print(f"in-process A/B: sidecar on {ab['on']:.0f}, off {ab['off']:.0f} samples/s "
                  f"(median of {ab['epochs_each']} epochs each)", flush=True)
    medians = {side: statistics.median(values) for side, values in runs.items() if values}
    ratio = medians["on"] / medians["off"] if medians else None
    share = statistics.median(shares) if shares else None
    load_after = os.getloadavg()[0]
    call_ns = phase_call_ns()
    result: dict[str, Any] = {
        "medians": medians, "runs": runs, "ratio": ratio, "repeats": args.repeats,
        "pair_ratios": [on / off for on, off in zip(runs["on"], runs["off"], strict=True)],
        "in_process_ab": ab, "sidecar_cpu_share": share, "phase_call_ns": call_ns,
        "epochs": args.epochs, "heartbeat_s": args.heartbeat_s, "world_size": WORLD,
        "load_average_before_after": [load_before, load_after], "cpus": os.cpu_count(),
        "command": " ".join(["python", "bench/sidecar_overhead.py", *sys.argv[1:]]),
    }
    for side, value in medians.items():
        print(f"median sidecar {side:3s} {value:9.0f} samples/s")
    if ratio is not None:
        print(f"ratio on / off {ratio:.3f} (target >= 0.99); pairs "
              + " ".join(f"{r:.2f}" for r in result["pair_ratios"]))
    if ab is not None:
        print(f"in-process A/B ratio on / off {ab['ratio']:.3f}")
    if share is not None:
        print(f"sidecar thread CPU: {100 * share:.3f} % of one core per rank (median over runs)")
    print(f"phase() call {call_ns:.0f} ns; heartbeat every {args.heartbeat_s} s; load average "
          f"{load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} CPUs")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
