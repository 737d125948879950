"""A user's 2-rank program with no timeout of its own; at its last step the ranks disagree on
the collective (rank 1 makes an extra barrier). ``EXPLICIT_TIMEOUT_S`` passes ``timeout=``.
``NEVER_JOIN_RANK`` never calls init_process_group. Prints the default timeout it got.
``ABORT_RANK`` ends by SIGABRT right after its timeout, as gloo tearing down sometimes makes
a rank end ("terminate called without an active exception"): the timeout must still be named.
"""

import datetime
import os
import time

import torch
import torch.distributed as dist

RANK = int(os.environ["RANK"])
explicit = os.environ.get("EXPLICIT_TIMEOUT_S")
if int(os.environ.get("NEVER_JOIN_RANK", "-1")) == RANK:
    time.sleep(3600)
print("default", dist.distributed_c10d.default_pg_timeout.total_seconds(), flush=True)
started = time.time()
try:
    if explicit:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(explicit)))
    else:
        dist.init_process_group("gloo")
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    started = time.time()
    if RANK == 1:
        dist.barrier()
    dist.all_reduce(tensor)
except Exception as exc:
    print(f"failed after {time.time() - started:.1f} s: {type(exc).__name__}: {exc}", flush=True)
    if int(os.environ.get("ABORT_RANK", "-1")) == RANK:
        os.abort()
    # Past gloo's teardown, which after a timeout sometimes aborts the process (SIGABRT) as it
    # exits: what is tested is the timeout, and this exit says the program saw it.
    os._exit(3)
print("no failure", flush=True)
