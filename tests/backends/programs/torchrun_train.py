"""A torchrun script, unchanged: it reads what torchrun gives every worker (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT through ``init_process_group()``'s env:// default) and trains a
tiny DDP model on CPU with gloo. Each worker writes ``OUT/rank-<rank>.json``: its process
group's rank and world size, torchrun's RANK, host, pid and a digest of the weights. With
``FAIL_RANK=R`` worker R exits 3 after its steps instead (its peers end 0)."""

from __future__ import annotations

import json
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    out = os.environ["OUT"]
    os.makedirs(out, exist_ok=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(777)
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank)
    for _ in range(int(os.environ.get("STEPS", "5"))):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(float(os.environ.get("PAUSE_S", "0.05")))
    if os.environ.get("FAIL_RANK") == str(rank):
        os._exit(3)
    digest = round(float(sum(p.sum() for p in model.parameters())), 6)
    record = {"rank": rank, "world_size": dist.get_world_size(), "env_rank": os.environ["RANK"],
              "local_rank": os.environ["LOCAL_RANK"], "host": socket.gethostname(),
              "pid": os.getpid(), "weights": digest}
    with open(os.path.join(out, f"rank-{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
