"""Throughput of ``python -m orchestrate.train`` against a minimal hand-written DDP loop.

Both train the digits example (examples/digits: the MLP with hidden=128, batch 32 per rank,
AdamW 3e-3) on 2 ranks with gloo on the CPU, one intra-op thread per rank. The hand loop is the
one the field notes start from: DistributedSampler + set_epoch, DDP, AdamW, nothing else (no
validation, checkpoints, metrics or stop-signal checks). The entrypoint runs the example's job
settings but, like the hand loop, checkpoints only at the end: on this toy an epoch lasts ~50 ms,
and a checkpoint every 50 ms measures the filesystem's journal, not the training loop
(``--with-epoch-checkpoints`` adds that variant). Each reports training samples/s per epoch
measured on rank 0 over the training loop only (global samples / seconds); a run's figure is the
median over its epochs after the first (warm-up). Runs alternate A B A B ... so that drift in the
machine's load hits both alike; the result is the median of each side and their ratio (target:
entrypoint / hand loop >= 0.97).

    python bench/train_throughput.py [--repeats 5] [--epochs 40] [--with-epoch-checkpoints]
                                     [--json out.json]

The machine's load average is printed before and after: on a shared machine other tenants'
load moves single runs by +-20%, which is why the runs alternate and medians are compared.
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
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"
WORLD = 2
HIDDEN = 128
BATCH = 32
LR = 3.0e-3
SEED = 777


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(argv: list[str], cwd: Path, logs: Path, result: Path) -> None:
    """Run ``argv`` as WORLD ranks with the torchrun environment; raise unless ``result``
    was written and every rank exited 0 (a crash after the result is reported, not fatal)."""
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {
            k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("SLURM_")
        }
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
            LOCAL_WORLD_SIZE=str(WORLD), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port), OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(REPO), str(DIGITS)]),
        )
        log = open(logs / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=log), log))
    codes = []
    for proc, log in procs:
        codes.append(proc.wait(timeout=600))
        log.close()
    if any(codes):
        text = (logs / "rank0.log").read_text() + (logs / "rank1.log").read_text()
        if not result.exists():
            raise RuntimeError(f"{argv[:4]} exited {codes}:\n{text[-3000:]}")
        print(f"  (note: {argv[1:3]} exited {codes} after finishing: {text.strip()[-200:]})",
              flush=True)


def run_entrypoint(epochs: int, work: Path, *, epoch_checkpoints: bool = False) -> list[float]:
    """One run of the entrypoint; per-epoch samples/s from its metrics.jsonl.

    Like the hand loop it checkpoints only at the end, unless ``epoch_checkpoints`` (the
    default of a job file, ``checkpoint_every_steps: 0``).
    """
    from orchestrate.core.spec.trainspec import TrainSpec

    spec = TrainSpec(
        model="digits:build_model", model_args={"hidden": HIDDEN},
        dataset="digits:build_dataset", optimizer={"name": "adamw", "lr": LR},  # type: ignore[arg-type]
        epochs=epochs, batch_size=BATCH, seed=SEED,
        checkpoint_every_steps=0 if epoch_checkpoints else 10**9,
    )
    config = work / "config.json"
    config.write_text(json.dumps(spec.model_dump(mode="json")))
    run_dir = work / "run"
    _launch(
        [sys.executable, "-m", "orchestrate.train", "--config", str(config),
         "--run-dir", str(run_dir)],
        DIGITS, work, run_dir / "metrics.jsonl",
    )
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["samples_per_s"] for r in records if r["kind"] == "epoch"]


def run_hand_loop(epochs: int, work: Path) -> list[float]:
    """One run of the hand-written loop (this file with ``--hand-loop``)."""
    out = work / "hand.json"
    _launch(
        [sys.executable, str(Path(__file__).resolve()), "--hand-loop", "--epochs", str(epochs),
         "--out", str(out)],
        DIGITS, work, out,
    )
    result: list[float] = json.loads(out.read_text())
    return result


def hand_loop(epochs: int, out: Path) -> None:
    """The minimal DDP loop of the field notes, timed like the entrypoint's epochs."""
    import digits
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    train, _ = digits.build_dataset()
    model = DistributedDataParallel(digits.build_model(hidden=HIDDEN))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, seed=SEED)
    loader = DataLoader(train, batch_size=BATCH, sampler=sampler)
    rates = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        started = time.perf_counter()
        for inputs, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), target)
            loss.backward()
            optimizer.step()
        rates.append(len(sampler) * world / (time.perf_counter() - started))
    if rank == 0:
        out.write_text(json.dumps(rates))
    dist.barrier()
    dist.destroy_process_group()


def _steady(rates: list[float]) -> float:
    return statistics.median(rates[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each side (>= 5)")
    parser.add_argument("--epochs", type=int, default=40, help="epochs per run")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--with-epoch-checkpoints", action="store_true",
        help="also run the entrypoint checkpointing every epoch (its job-file default)",
    )
    parser.add_argument("--hand-loop", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hand_loop:
        hand_loop(args.epochs, args.out)
        return 0
    sides: dict[str, Any] = {
        "entrypoint": run_entrypoint,
        "hand loop": run_hand_loop,
    }
    if args.with_epoch_checkpoints:
        sides["entrypoint+ckpt"] = lambda epochs, work: run_entrypoint(
            epochs, work, epoch_checkpoints=True
        )
    runs: dict[str, list[float]] = {name: [] for name in sides}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="train-bench-") as tmp:
        for i in range(args.repeats):
            for name, runner in sides.items():
                work = Path(tmp) / f"{name.replace(' ', '-')}-{i}"
                work.mkdir()
                runs[name].append(_steady(runner(args.epochs, work)))
                print(f"run {i + 1}/{args.repeats} {name:16s} {runs[name][-1]:9.0f} samples/s",
                      flush=True)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    result: dict[str, Any] = {
        "medians": medians,
        "runs": runs,
        "ratio": medians["entrypoint"] / medians["hand loop"],
        "repeats": args.repeats,
        "epochs": args.epochs,
        "world_size": WORLD,
        "load_average_before_after": [load_before, os.getloadavg()[0]],
        "cpus": os.cpu_count(),
        "command": " ".join(["python", "bench/train_throughput.py", *sys.argv[1:]]),
    }
    if "entrypoint+ckpt" in medians:
        result["ratio_with_epoch_checkpoints"] = (
            medians["entrypoint+ckpt"] / medians["hand loop"]
        )
    for name, value in medians.items():
        print(f"median {name:16s} {value:9.0f} samples/s")
    print(f"ratio entrypoint / hand loop {result['ratio']:.3f} (target >= 0.97); load average "
          f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if "ratio_with_epoch_checkpoints" in result:
        print(f"ratio with a checkpoint every epoch {result['ratio_with_epoch_checkpoints']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
