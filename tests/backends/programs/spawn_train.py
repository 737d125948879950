"""The field notes' DDP program (their ``ddp_setup`` / ``ddp_train`` wrapped in
``torch.multiprocessing.spawn``), kept as the notes write it, on CPU with gloo.

What changed from the notes, and why (docs/launchers.md, "Bringing an existing program"): the
hard-coded ``MASTER_ADDR='localhost'`` and port are dropped (orchestrate sets both), and the
world comes from the node's launcher variables (``NNODES``, ``NODE_RANK``, ``NPROC_PER_NODE``,
``WORLD_SIZE``) instead of ``torch.cuda.device_count()`` on one machine.

``SPAWN_MODE=notes`` runs the notes' original setup instead: localhost, a port of its own, a
world of this machine's workers only -- what the notes' code does when it is brought unchanged
into a ``ranks`` job (each process builds a separate world).

Each worker writes ``OUT/started-<rank>.txt`` (its host and pid) once it joined, and
``OUT/rank-<rank>.json`` at the end: the rank and world size its process group has, its
host and pid, and a digest of the trained weights (equal on every rank of one world).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def ddp_setup(rank: int, world_size: int, port_num: str | None = None) -> None:
    if port_num is not None:  # the notes: os.environ['MASTER_ADDR'] = 'localhost', a fixed port
        os.environ["MASTER_ADDR"] = "localhost"
        os.environ["MASTER_PORT"] = port_num
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def ddp_train(proc: int, first_rank: int, world_size: int, port_num: str | None, out: str,
              steps: int, pause_s: float) -> None:
    torch.manual_seed(777)
    rank = first_rank + proc
    ddp_setup(rank, world_size, port_num)
    with open(os.path.join(out, f"started-{rank}.txt"), "w", encoding="utf-8") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}\n")  # where a test finds the worker
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank)  # every rank sees different data: only DDP keeps them equal
    for _ in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(pause_s)
    digest = round(float(sum(p.sum() for p in model.parameters())), 6)
    record = {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
              "host": socket.gethostname(), "pid": os.getpid(), "weights": digest}
    with open(os.path.join(out, f"rank-{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(record, f)
    dist.destroy_process_group()


def main() -> None:
    out = os.environ["OUT"]
    os.makedirs(out, exist_ok=True)
    steps = int(os.environ.get("STEPS", "5"))
    pause_s = float(os.environ.get("PAUSE_S", "0.05"))
    if os.environ.get("SPAWN_MODE") == "notes":
        nprocs = int(os.environ.get("NOTES_NPROCS", "1"))  # the notes: torch.cuda.device_count()
        first_rank, world_size, port_num = 0, nprocs, free_port()
    else:
        nprocs = int(os.environ["NPROC_PER_NODE"])
        node_rank = int(os.environ["NODE_RANK"])
        # NODE_RANK * NPROC_PER_NODE on even nodes; ORCHESTRATE_FIRST_RANK on uneven ones.
        first_rank = int(os.environ.get("ORCHESTRATE_FIRST_RANK", node_rank * nprocs))
        world_size, port_num = int(os.environ["WORLD_SIZE"]), None
    mp.spawn(ddp_train, args=(first_rank, world_size, port_num, out, steps, pause_s),
             nprocs=nprocs)


if __name__ == "__main__":
    main()
    sys.exit(0)
