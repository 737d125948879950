"""A user's own DDP program (gloo on CPU) that reports its steps to orchestrate with the one
documented line (``from orchestrate_steps import report``, docs/launchers.md).

It joins the world from the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR/PORT``), or,
as pytorch/examples' imagenet does, from its arguments: ``--dist-url tcp://HOST:PORT
--world-size NODES --rank NODE --multiprocessing-distributed`` spawns one worker per GPU (here:
per ``NPROC_PER_NODE`` on a machine without them), worker i joining as rank NODE * n + i of a
world of NODES * n. ``STEPS`` steps; with ``NAN_AT=S`` the loss of rank ``NAN_RANK``
(default 0) is NaN from step S on. Each rank writes ``OUT/rank-<rank>.json`` at the end: its
process group's rank and world size and how it was told them."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from orchestrate_steps import report
from torch.nn.parallel import DistributedDataParallel as DDP


def _worker(index: int, args: argparse.Namespace, per_node: int) -> None:
    dist.init_process_group("gloo", init_method=args.dist_url,
                            world_size=args.world_size * per_node,
                            rank=args.rank * per_node + index)
    train("args")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dist-url")
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--multiprocessing-distributed", action="store_true")
    args, _ = parser.parse_known_args()  # imagenet's own options (-a, --dist-backend, data)
    if args.dist_url is None:
        dist.init_process_group("gloo")
        train("env")
    elif args.multiprocessing_distributed:  # imagenet's main(): one worker per GPU
        per_node = torch.cuda.device_count() or int(os.environ["NPROC_PER_NODE"])
        mp.spawn(_worker, args=(args, per_node), nprocs=per_node)
    else:
        _worker(0, args, 1)


def train(told: str) -> None:
    rank = dist.get_rank()
    torch.manual_seed(777)
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(rank)
    nan_at = int(os.environ.get("NAN_AT", "0"))
    for step in range(1, int(os.environ.get("STEPS", "20")) + 1):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        if nan_at and step >= nan_at and rank == int(os.environ.get("NAN_RANK", "0")):
            loss = loss * float("nan")
        optimizer.zero_grad()
        started = time.perf_counter()
        loss.backward()
        backward_s = time.perf_counter() - started
        optimizer.step()
        report(step, loss.item(), samples=8, backward_s=backward_s)
        time.sleep(float(os.environ.get("PAUSE_S", "0.02")))
    out = os.environ["OUT"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank-{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "world_size": dist.get_world_size(), "told": told}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
