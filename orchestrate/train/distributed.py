"""Joining and leaving the process group, and the device each rank drives.

Lessons from the field (docs/train.md): bind ``cuda:LOCAL_RANK`` before any other CUDA work, use
nccl on GPUs and gloo on CPUs, and never wait forever. Every collective here has a finite timeout
(``ORCHESTRATE_TIMEOUT_S``, 300 s by default) instead of torch's 30 minutes, so a rank that died
or never started is an error within minutes, not a frozen job.

Besides the training group, every multi-rank job gets a small gloo *control* group on the CPU. It
carries what is not gradient data (the stop flag, setup outcomes, RNG states for checkpoints), so
those exchanges never queue behind gradient buckets and never need a GPU synchronization, and a
rank that dies is noticed through its closed TCP connection even while nccl would keep waiting.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import HashStore, Store, TCPStore  # type: ignore[attr-defined]

from orchestrate.core.errors import Problem, UserError, show_value
from orchestrate.train.env import DistEnv

DEFAULT_TIMEOUT_S = 300.0
LEAVE_BACKSTOP_S = 10.0  # after a failure, exit anyway if leaving the group takes longer
BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class Cluster:
    """This rank's membership: where it is, what it computes on, and how it talks."""

    env: DistEnv
    device: torch.device
    backend: str
    timeout_s: float
    control: dist.ProcessGroup | None  # None in a single-process job

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size


def timeout_from(environ: Mapping[str, str]) -> float:
    """Seconds any collective may wait, from ``ORCHESTRATE_TIMEOUT_S`` (default 300)."""
    raw = environ.get("ORCHESTRATE_TIMEOUT_S", "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise UserError(
            Problem(
                "must be a positive number of seconds",
                source="environment",
                field="ORCHESTRATE_TIMEOUT_S",
                got=show_value(raw),
            )
        )
    return value


def backend_from(environ: Mapping[str, str], cuda: bool) -> str:
    """nccl on GPUs, gloo on CPUs, unless ``ORCHESTRATE_DIST_BACKEND`` says otherwise."""
    raw = environ.get("ORCHESTRATE_DIST_BACKEND", "").strip().lower()
    if not raw:
        return "nccl" if cuda else "gloo"
    if raw not in BACKENDS:
        raise UserError(
            Problem(
                "must be nccl or gloo",
                source="environment",
                field="ORCHESTRATE_DIST_BACKEND",
                got=show_value(raw),
            )
        )
    if raw == "nccl" and not cuda:
        raise UserError(
            Problem(
                "nccl needs CUDA GPUs, and this rank sees none",
                source="environment",
                field="ORCHESTRATE_DIST_BACKEND",
                got="nccl",
                hint="unset it (gloo is used on CPUs) or check CUDA_VISIBLE_DEVICES",
            )
        )
    return raw


def cpu_threads(env: DistEnv, environ: Mapping[str, str]) -> int | None:
    """Intra-op threads for a CPU rank: the CPUs shared by the node's ranks, unless
    ``OMP_NUM_THREADS`` decides. Without it every rank would use all cores and they would fight.
    """
    if environ.get("OMP_NUM_THREADS", "").strip():
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // env.local_world_size)


def join(env: DistEnv, environ: Mapping[str, str]) -> Cluster:
    """Bind the device, then join the process group (and the control group)."""
    cuda = torch.cuda.is_available()
    if cuda:
        if env.local_rank >= torch.cuda.device_count():
            raise UserError(
                Problem(
                    f"is {env.local_rank} but this rank sees only "
                    f"{torch.cuda.device_count()} GPU(s)",
                    source="environment",
                    field="LOCAL_RANK",
                    hint="every local rank must see all of the node's job GPUs "
                    "(CUDA_VISIBLE_DEVICES)",
                )
            )
        # First CUDA call of the process: everything after lands on this rank's GPU.
        torch.cuda.set_device(env.local_rank)
    backend = backend_from(environ, cuda)
    timeout_s = timeout_from(environ)
    if cuda and backend == "gloo":
        warnings.warn(
            "gloo on GPUs is 5-20x slower than nccl for gradients; set by "
            "ORCHESTRATE_DIST_BACKEND",
            stacklevel=2,
        )
    threads = None if cuda else cpu_threads(env, environ)
    if threads is not None:
        torch.set_num_threads(threads)
    device = torch.device("cuda", env.local_rank) if cuda else torch.device("cpu")
    timeout = timedelta(seconds=timeout_s)
    store: Store
    if env.world_size == 1 and env.master_port == 0:
        store = HashStore()
    else:
        store = TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=env.rank == 0,
            timeout=timeout,
        )
    dist.init_process_group(
        backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=device if backend == "nccl" else None,
    )
    control = None
    if env.world_size > 1:
        control = dist.new_group(backend="gloo", timeout=timeout)
    return Cluster(env, device, backend, timeout_s, control)


def leave(cluster: Cluster | None, *, failed: bool) -> None:
    """Leave the process group; after a failure, abort (nccl) so nothing waits on dead peers.

    The caller drops its model first; the garbage collector then frees what cycles still hold,
    so that DDP's reducer goes while the world holds the group. Destroyed first, the group's
    last owner would be the reducer, whose release (here or at the interpreter's exit) joins
    gloo's threads holding the GIL one of them may wait for (pytorch/pytorch#56297), or tears
    them down with the interpreter (SIGABRT)."""
    if not dist.is_initialized():
        return
    gc.collect()
    if not failed:
        dist.destroy_process_group()
        return
    # Backstop: a teardown that blocks on a dead peer must not keep this rank alive.
    backstop = _exit_after(LEAVE_BACKSTOP_S, 1)
    try:
        if cluster is not None and cluster.backend == "nccl":
            try:
                dist.distributed_c10d._abort_process_group()
                return
            except Exception:  # older torch or already aborted: fall through to destroy
                pass
        try:
            dist.destroy_process_group()
        except Exception as exc:  # leaving must not hide the error that got us here
            print(f"(destroy_process_group after the error failed too: {exc})", file=sys.stderr)
    finally:
        backstop.cancel()


def _exit_after(seconds: float, status: int) -> threading.Timer:
    def _force() -> None:
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(status)

    timer = threading.Timer(seconds, _force)
    timer.daemon = True
    timer.start()
    return timer
