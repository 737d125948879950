"""A user's plain DDP-style program (no orchestrate import): steps of one all_reduce each.

The scenario comes from the environment, as a test sets it: ``SCENARIO`` = healthy | mismatch |
laggard | frozen | rendezvous | compute | solo | slowio | teardown, ``BAD_RANK``,
``TRIGGER_STEP``, ``STEPS`` (how many steps before exiting 0; healthy, compute, solo, slowio and
teardown end; in teardown the bad rank then hangs in the interpreter's teardown), ``PAUSE_S``
(healthy: rank 0's pause, a stand-in for a long rank-0-only checkpoint), ``SELF_STOP`` (frozen:
the rank stops itself), ``BUSY_S`` (compute: every rank computes this long in one step, with no
collective; solo: the bad rank computes alone while the others wait in a barrier; slowio: the
bad rank reads slow storage this long, forever when negative, while the others wait in
all_reduce). At the trigger, the bad rank writes ``$MARKS/trigger`` so the test knows when the
trouble began (compute: every rank, ``$MARKS/trigger-R``).
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
BUSY_S = float(os.environ.get("BUSY_S", "0"))


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


def compute(seconds):
    """One long CPU step: the main thread computes, no collective."""
    end = time.time() + seconds
    total = 0
    while time.time() < end:
        total += sum(i * i for i in range(2000))
    return total


def busy_step(step):
    """The compute, solo and slowio scenarios at their trigger step."""
    if step != TRIGGER:
        return
    if SCENARIO == "compute":
        mark(f"trigger-{RANK}")
        compute(BUSY_S)
    elif SCENARIO == "solo":
        if RANK == BAD:
            mark("trigger")
            compute(BUSY_S)
        dist.barrier()  # the others wait here while the bad rank computes alone
    elif SCENARIO == "slowio" and RANK == BAD:
        from slowstore import slow_read

        mark("trigger")
        slow_read(BUSY_S)  # the slow read


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
        busy_step(step)
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()


class HeldAtExit:
    """Freed in the interpreter's teardown, after every atexit handler (the sidecar's last
    heartbeat included), it blocks there in native code holding the GIL, as a process group
    destroyed from C++ does while a gloo thread waits for the GIL (pytorch/pytorch#56297)."""

    def __init__(self):
        import ctypes

        self.pause = ctypes.PyDLL(None).pause  # a PyDLL call keeps the GIL

    def __del__(self):
        self.pause()  # until a signal: the launcher's SIGTERM ends the process


if __name__ == "__main__":
    train()
    if SCENARIO == "teardown" and RANK == BAD:
        mark("trigger")
        held = HeldAtExit()
