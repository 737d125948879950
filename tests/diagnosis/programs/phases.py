"""A plain program that walks through every automatic phase; rank 1 joins late, so rank 0 sits
in init_process_group for a while. Writes ``$MARKS/end`` with its clock just before exiting."""

import os
import time

import torch
import torch.distributed as dist

RANK = int(os.environ["RANK"])
time.sleep(2.0)  # "start": interpreter up, not joined
if RANK == 1:
    time.sleep(3.0)  # rank 0 waits for us in init_process_group meanwhile
dist.init_process_group("gloo")
tensor = torch.ones(4)
for _ in range(20):
    dist.all_reduce(tensor)
    time.sleep(0.1)  # "running"
dist.destroy_process_group()
time.sleep(2.0)  # "finished"
with open(os.path.join(os.environ["MARKS"], f"end-{RANK}"), "w") as handle:
    handle.write(str(time.time()))
