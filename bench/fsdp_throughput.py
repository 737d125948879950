"""Throughput of ``python -m orchestrate.train`` under ``strategy: fsdp`` against a minimal
hand-written FSDP2 loop (issue #24, target ratio >= 0.97).

Both train the digits example (examples/digits: the MLP, hidden=512 so that its weights are
larger than glibc's small-block sizes, batch 32 per rank, AdamW 3e-3, fp32) on 2 ranks with gloo
on the CPU, one intra-op thread per rank. The hand loop is what a user writes from the FSDP2
tutorial: DistributedSampler + set_epoch, ``fully_shard`` on each layer then on the model (the
units ``fsdp.wrap: auto`` picks for this model: its Linear layers), AdamW built after it,
nothing else (no validation, checkpoints, metrics, peak-memory measurement or stop-signal
checks). The entrypoint checkpoints only at the end, like the hand loop. Each side reports
training samples/s per epoch on rank 0 (global samples / seconds); a run's figure is the median
over its epochs after the first. Runs alternate A B A B ... (bench/train_throughput.py's launch
and method); the result is the median of each side and their ratio.

    python bench/fsdp_throughput.py [--repeats 5] [--epochs 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_throughput import BATCH, DIGITS, LR, SEED, WORLD, _launch, _steady

HIDDEN = 512


def run_entrypoint(epochs: int, work: Path) -> list[float]:
    """One run of the entrypoint under FSDP; per-epoch samples/s from its metrics.jsonl."""
    from orchestrate.core.spec.trainspec import TrainSpec

    spec = TrainSpec(
        model="digits:build_model", model_args={"hidden": HIDDEN, "dropout": 0.0},
        dataset="digits:build_dataset", optimizer={"name": "adamw", "lr": LR},  # type: ignore[arg-type]
        strategy="fsdp", epochs=epochs, batch_size=BATCH, seed=SEED,
        checkpoint_every_steps=10**9,
    )
    config = work / "config.json"
    config.write_text(json.dumps(spec.model_dump(mode="json")))
    run_dir = work / "run"
    _launch([sys.executable, "-m", "orchestrate.train", "--config", str(config),
             "--run-dir", str(run_dir)], DIGITS, work, run_dir / "metrics.jsonl")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["samples_per_s"] for r in records if r["kind"] == "epoch"]


def run_hand_loop(epochs: int, work: Path) -> list[float]:
    """One run of the hand-written FSDP2 loop (this file with ``--hand-loop``)."""
    out = work / "hand.json"
    _launch([sys.executable, str(Path(__file__).resolve()), "--hand-loop", "--epochs",
             str(epochs), "--out", str(out)], DIGITS, work, out)
    result: list[float] = json.loads(out.read_text())
    return result


def hand_loop(epochs: int, out: Path) -> None:
    """The minimal FSDP2 loop, timed like the entrypoint's epochs."""
    import digits
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    train, _ = digits.build_dataset()
    model = digits.build_model(hidden=HIDDEN, dropout=0.0)
    for layer in model:  # the units orchestrate's wrap: auto picks here (the repeated Linear)
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each side")
    parser.add_argument("--epochs", type=int, default=30, help="epochs per run")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--hand-loop", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hand_loop:
        hand_loop(args.epochs, args.out)
        return 0
    sides = {"entrypoint fsdp": run_entrypoint, "hand fsdp2 loop": run_hand_loop}
    runs: dict[str, list[float]] = {name: [] for name in sides}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fsdp-bench-") as tmp:
        for i in range(args.repeats):
            for name, runner in sides.items():
                work = Path(tmp) / f"{name.replace(' ', '-')}-{i}"
                work.mkdir()
                runs[name].append(_steady(runner(args.epochs, work)))
                print(f"run {i + 1}/{args.repeats} {name:16s} {runs[name][-1]:9.0f} samples/s",
                      flush=True)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    ratio = medians["entrypoint fsdp"] / medians["hand fsdp2 loop"]
    result: dict[str, Any] = {
        "medians": medians, "runs": runs, "ratio": ratio, "repeats": args.repeats,
        "epochs": args.epochs, "world_size": WORLD, "hidden": HIDDEN,
        "load_average_before_after": [load_before, os.getloadavg()[0]], "cpus": os.cpu_count(),
    }
    for name, value in medians.items():
        print(f"median {name:16s} {value:9.0f} samples/s")
    print(f"ratio entrypoint / hand loop {ratio:.3f} (target >= 0.97); load average "
          f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
