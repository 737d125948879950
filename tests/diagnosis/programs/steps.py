"""A user's plain DDP-style program (no orchestrate import): steps of one all_reduce each.

The scenario comes from the environment, as a test sets it: ``SCENARIO`` = healthy | mismatch |
laggard | frozen | rendezvous, ``BAD_RANK``, ``TRIGGER_STEP``, ``STEPS`` (healthy: how many
steps before exiting 0), ``PAUSE_S`` (healthy: rank 0's pause, a stand-in for a long rank-0-only
checkpoint), ``SELF_STOP`` (frozen: the rank stops itself). At the trigger, the bad rank writes
``$MARKS/trigger`` so the test knows when the trouble began.
"""

import os
import time

import torch
import torch.distributed as dist

SCENARIO = os.environ.get("SCENARIO", "healthy")
RANK = int(os.environ["RANK"])
BAD = int(os.environ.get("BAD_RANK", "-1"))
TRIGGER = int(os.environ.get("TRIGGER_STEP", "15"))
STEPS = int(os.environ.get("STEPS", "1000000"))
PAUSE_S = float(os.environ.get("PAUSE_S", "0"))


def mark(name):
    marks = os.environ.get("MARKS")
    if marks:
        with open(os.path.join(marks, name), "w") as handle:
            handle.write(str(time.time()))


class Batches:
    """A data iterator; the bad rank's one stops delivering (a stuck read)."""

    def __init__(self, stuck_at):
        self.count = 0
        self.stuck_at = stuck_at

    def __iter__(self):
        return self

    def __next__(self):
        self.count += 1
        if self.count == self.stuck_at:
            mark("trigger")
            time.sleep(3600)  # the stuck read
        return torch.ones(8)


def prepare():
    """Setup before joining; the bad rank of the rendezvous scenario never finishes it."""
    if SCENARIO == "rendezvous" and RANK == BAD:
        mark("trigger")
        time.sleep(3600)  # never joins


def save_checkpoint():
    mark("pause")
    time.sleep(PAUSE_S)


def train():
    prepare()
    dist.init_process_group("gloo")
    stuck_at = TRIGGER if SCENARIO == "laggard" and RANK == BAD else -1
    batches = Batches(stuck_at)
    for step in range(STEPS):
        batch = next(batches)
        if SCENARIO == "mismatch" and RANK == BAD and step == TRIGGER:
            mark("trigger")
            dist.barrier()  # an extra collective the other ranks do not make
        dist.all_reduce(batch)
        if SCENARIO == "frozen" and RANK == BAD and step == TRIGGER:
            mark("ready")  # the test stops this process now
            if os.environ.get("SELF_STOP"):  # or, where the test cannot reach the process:
                os.kill(os.getpid(), 19)  # SIGSTOP, the whole process (its sidecar too)
        if SCENARIO == "healthy" and RANK == 0 and step == TRIGGER:
            save_checkpoint()
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
