"""The join watch: whether a Python process of a job forms a process group, and as what.

A rank's own sidecar (:mod:`orchestrate.diagnosis.sidecar`) starts in the process a launch
script starts for that rank. Every other Python process of the job gets this instead (from the
sidecar folder's ``sitecustomize``: :mod:`orchestrate.diagnosis.activation`): the process a
``per_node`` node starts and the workers it spawns (``torch.multiprocessing.spawn``), torchrun's
agent, the workers that torchrun or mp.spawn start inside a ``ranks`` job, DataLoader workers.

Every process of the job, a rank's own included, records each process group it forms at the
moment ``init_process_group`` returns (:func:`hook`): an import hook on ``sys.meta_path``
waits for the program to import ``torch.distributed`` (it never imports torch itself) and then
wraps ``init_process_group`` (``torch.distributed``'s and ``distributed_c10d``'s). So a world
that lives under a second is recorded, and so is a second world a process forms after the first
(destroy, then init again as a world of 1: ``<host>-<pid>-2.json``). On each join:

- under a launcher that starts workers (``ORCHESTRATE_LAUNCHER``: ``per_node``, ``torchrun``)
  and with no other sidecar of the job running above it, the process becomes the rank it joined
  as: its sidecar starts for that rank (heartbeats, stacks on request);
- the join is recorded (:func:`record`): the rank and world size it joined with, which the
  launcher's world check (:mod:`orchestrate.diagnosis.world`) compares with the plan, so that a
  program that builds its own world (mp.spawn or torchrun inside a ``ranks`` job) is named at
  once instead of training separate models to a COMPLETED job.

A program that binds ``init_process_group`` before ``torch.distributed`` finished importing
(torch's own modules) is still seen by the fallback: a daemon thread (:func:`watch`) that looks
about once a second whether its process has initialised ``torch.distributed``, and records the
join once; a rank's sidecar does the same at every heartbeat. A forked child starts its own
watch. It costs a sleeping thread and a name compare per import; the records, the sidecar and
their imports load only in a process that joins. Standard library only, Python 3.8+.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

    #: Starts this process's sidecar as rank R: ``start(run_dir, rank)`` (the sidecar's own,
    #: passed in by :mod:`orchestrate.diagnosis.activation`; the sidecar imports this module).
    Starter = Callable[[str, int], Any]

ENV_ATTEMPT = "ORCHESTRATE_ATTEMPT"
ENV_LAUNCHER = "ORCHESTRATE_LAUNCHER"
ENV_OWNER = "ORCHESTRATE_SIDECAR_PID"
#: Attribute of ``sys`` holding the live sidecar (either copy of the sidecar module finds it).
LIVE_KEY = "_orchestrate_sidecar"
LOOK_S = 1.0

_watching: list[int] = []  # the pid whose watch runs (a forked child starts its own)
_fork_hook: list[bool] = []
_hooked: list[bool] = []  # the import hook is in place (once per interpreter)
_joins: dict[int, int] = {}  # by pid: how many process groups this process recorded
#: Marks our wrapper of ``init_process_group`` (never wrapped twice).
WRAPPED = "_orchestrate_join_hook"


def live_sidecar() -> Any:
    """The sidecar running in this process (not one inherited through fork), or None."""
    car = getattr(sys, LIVE_KEY, None)
    if car is not None and getattr(car, "pid", None) == os.getpid():
        return car
    return None


def owner_elsewhere(environ: Any) -> bool:
    """Whether another live process of the job (our parent, usually) runs the sidecar that the
    processes it starts belong to."""
    raw = str(environ.get(ENV_OWNER, "")).strip()
    if not raw.isdigit() or int(raw) == os.getpid():
        return False
    try:
        os.kill(int(raw), 0)
    except ProcessLookupError:
        return False  # stale: left by a process that is gone
    except OSError:
        return True  # alive, but not ours to signal
    return True


def dist_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` of this process's default process group once it is initialised,
    without importing torch."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:
        return None


def record(run_dir: str, rank: int, world_size: int, heartbeats: bool, n: int = 1) -> None:
    """Write this process's ``n``-th join (``diag/joined/<attempt>/<host>-<pid>.json``, then
    ``<host>-<pid>-<n>.json``); never raises."""
    try:
        import json
        import socket
        from pathlib import Path

        from orchestrate.diagnosis.diagfiles import DiagFiles, Joined

        raw_rank = os.environ.get("RANK", "").strip()
        raw_attempt = os.environ.get(ENV_ATTEMPT, "").strip()
        attempt = int(raw_attempt) if raw_attempt.isdigit() else 1
        host, pid = socket.gethostname(), os.getpid()
        joined = Joined(pid, host, rank, world_size,
                        int(raw_rank) if raw_rank.isdigit() else None, time.time(), heartbeats)
        path = DiagFiles(Path(run_dir)).joined_by(attempt, host, pid, n)
        os.makedirs(str(path.parent), exist_ok=True)
        # One name per thread: the wrapper and a just-started sidecar may record the same join
        # at once, and two writers of one temporary file leave a tail of the longer record.
        temporary = f"{path}.{pid}.{threading.get_ident()}.tmp"
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(joined.to_json()))
        os.replace(temporary, str(path))
    except Exception as exc:  # the world check loses one process; the program never notices
        try:  # noqa: SIM105 - contextlib would be an import in every process of the job
            sys.stderr.write(f"orchestrate sidecar: cannot record the process group this "
                             f"process joined: {type(exc).__name__}: {exc}\n")
        except Exception:
            pass


def watch(run_dir: str, environ: Any, start: Starter) -> None:
    """Start this process's join watch (once per process; see the module docstring); ``start``
    starts the sidecar of a process that becomes the rank it joined as."""
    if _watching == [os.getpid()]:
        return
    _watching[:] = [os.getpid()]
    upgrade = str(environ.get(ENV_LAUNCHER, "ranks")) != "ranks" and not owner_elsewhere(environ)
    thread = threading.Thread(target=_run, args=(run_dir, upgrade, start), daemon=True,
                              name="orchestrate-joinwatch")
    thread.start()
    if not _fork_hook and hasattr(os, "register_at_fork"):
        _fork_hook.append(True)
        os.register_at_fork(after_in_child=lambda: _after_fork(run_dir, start))


def _after_fork(run_dir: str, start: Starter) -> None:
    try:  # noqa: SIM105 - contextlib would be an import in every process of the job
        watch(run_dir, os.environ, start)
    except Exception:
        pass


def _run(run_dir: str, upgrade: bool, start: Starter) -> None:
    try:
        while True:
            time.sleep(LOOK_S)
            if live_sidecar() is not None or _joins.get(os.getpid()):
                return  # a sidecar of this process, or the hook, records the join
            joined = dist_world()
            if joined is None:
                continue
            if upgrade:
                start(run_dir, joined[0])  # its first heartbeat records the join
            else:
                record(run_dir, joined[0], joined[1], heartbeats=False)
            destroy_at_exit()
            return
    except BaseException:  # never let an error of ours reach the program
        return


# --- the synchronous record: init_process_group wrapped at import -------------------------


def hook(run_dir: str, start: Starter) -> None:
    """Wrap ``init_process_group`` once ``torch.distributed`` is imported (now, if it is), so
    that each join is recorded when it happens (see the module docstring); once a process."""
    if _hooked:
        return
    _hooked.append(True)
    loaded = sys.modules.get("torch.distributed")
    if loaded is not None:
        _wrap(loaded, run_dir, start)
        return
    sys.meta_path.insert(0, _Finder(run_dir, start))


class _Finder:
    """A meta path finder that finds nothing itself: when ``torch.distributed`` is imported it
    asks the finders after it, and has the module's loader wrap ``init_process_group`` once the
    module has run."""

    def __init__(self, run_dir: str, start: Starter) -> None:
        self.run_dir = run_dir
        self.start = start

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch.distributed":
            return None
        if self in sys.meta_path:  # one module to watch: stay out of every later import
            sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
            loader = getattr(spec, "loader", None)
            run = getattr(loader, "exec_module", None)
            if loader is None or run is None:
                return spec
            run_dir, start = self.run_dir, self.start

            def exec_module(module: Any) -> None:
                run(module)
                _wrap(module, run_dir, start)

            loader.exec_module = exec_module
            return spec
        except Exception:  # the program imports torch.distributed as if we were not here
            return None


def _wrap(dist: Any, run_dir: str, start: Starter) -> None:
    """Replace ``init_process_group`` in ``torch.distributed`` and ``distributed_c10d`` by a
    wrapper that records the join after it returns; never raises."""
    try:
        import functools

        for owner in (dist, sys.modules.get("torch.distributed.distributed_c10d")):
            original = getattr(owner, "init_process_group", None)
            if original is None or getattr(original, WRAPPED, False):
                continue

            def wrapped(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
                wait_for_store(args, kwargs, os.environ)
                result = __original(*args, **kwargs)
                joined_now(run_dir, start)
                return result

            functools.update_wrapper(wrapped, original)
            setattr(wrapped, WRAPPED, True)
            setattr(owner, "init_process_group", wrapped)  # noqa: B010 - a module's attribute
    except Exception:
        return


# --- the store: a rank that comes before rank 0 asks for it every 10 ms, not torch's 0.5 s --------

#: How often, and for how long at most (or the ``timeout`` given to ``init_process_group``, if
#: shorter), a rank asks whether rank 0's store listens; after that torch's own retries take
#: over (until that timeout, as without this).
STORE_POLL_S = 0.01
STORE_WAIT_S = 60.0


def wait_for_store(args: Any, kwargs: Any, environ: Any) -> None:
    """Before ``init_process_group`` connects a rank other than 0 to rank 0's store
    (``env://``: ``MASTER_ADDR:MASTER_PORT``), wait until that store listens.

    Why: torch's client, refused because rank 0 has not opened its store yet (it imports torch
    a little later, or starts later on another node), sleeps 0.25-0.75 s before it tries again
    (exponential backoff, 0.5 s first); every start whose rank 0 comes last lost that. A
    connect refused here costs 10 ms. The connection is closed at once, unused (the store
    takes that from any client). Never raises: whatever happens, torch connects as before.
    Named as the sidecar's phase looks for it (``init_process_group``)."""
    try:
        if kwargs.get("store") is not None or len(args) > 5:
            return
        method = kwargs.get("init_method", args[1] if len(args) > 1 else None)
        rank = kwargs.get("rank", args[4] if len(args) > 4 else -1)
        if rank in (-1, None):
            rank = int(environ.get("RANK", "0"))
        addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
        if method not in (None, "env://") or int(rank) == 0 or not addr or not port:
            return
        import socket

        limit = kwargs.get("timeout", args[2] if len(args) > 2 else None)  # the job's own bound
        seconds = limit.total_seconds() if hasattr(limit, "total_seconds") else STORE_WAIT_S
        deadline = time.monotonic() + min(STORE_WAIT_S, seconds)
        while time.monotonic() < deadline:
            try:
                socket.create_connection((addr, int(port)), timeout=1.0).close()
                return
            except socket.gaierror:  # a name that does not resolve: torch says so at once
                return
            except OSError:
                time.sleep(STORE_POLL_S)
    except Exception:
        return


def joined_now(run_dir: str, start: Starter) -> None:
    """This process just formed a process group: become its rank (a worker under ``per_node``
    or ``torchrun``), then record the join; never raises into the program."""
    try:
        world = dist_world()
        if world is None:
            return
        pid = os.getpid()
        n = _joins.get(pid, 0) + 1
        _joins[pid] = n
        car = live_sidecar()
        if car is None and n == 1 and str(os.environ.get(ENV_LAUNCHER, "ranks")) != "ranks" \
                and not owner_elsewhere(os.environ):
            car = start(run_dir, world[0])
        if car is not None:
            car._joined = True  # its heartbeats need not record it again
        record(run_dir, world[0], world[1], heartbeats=car is not None, n=n)
        destroy_at_exit()
    except Exception:
        return


# --- the exit: a gloo world left standing is destroyed while Python is whole -----------------

_destroying: list[int] = []  # the pid whose exit handler is registered


def destroy_at_exit() -> None:
    """Destroy the process's gloo world at exit if the program left it standing; once a
    process.

    A program that ends without ``destroy_process_group()`` (Lightning's ``Trainer.fit`` never
    calls it) leaves gloo's worker threads holding work whose tensors point into Python. When
    the interpreter is torn down they are destroyed without the GIL and C++ aborts the process:
    ``terminate called without an active exception``, SIGABRT. The training succeeded, yet the
    rank fails; on this machine a 4-rank gloo world aborted 9 of 120 times in a loop, never once
    with the destroy. So an ``atexit`` handler, registered when the process joins (after the
    program's own, so it runs before them), destroys a still-initialised world whose backend is
    gloo alone. Destroying a gloo group is local (no peer waits on it). NCCL worlds are left
    alone: their teardown is the program's to order against pending GPU work."""
    if _destroying == [os.getpid()]:
        return
    _destroying[:] = [os.getpid()]
    import atexit

    atexit.register(_destroy_left_gloo_world, os.getpid())


def _destroy_left_gloo_world(pid: int) -> None:
    if os.getpid() != pid:  # a forked child inherited the handler: the world is its parent's
        return
    try:
        dist: Any = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return
        if str(dist.get_backend()) != "gloo":
            return
        # A DDP model still alive at exit (a reference cycle's garbage: frameworks keep them)
        # would be the group's last owner once it is destroyed, and its release in the
        # interpreter's teardown joins gloo's threads holding the GIL (pytorch/pytorch#56297):
        # collected first, it lets the group go while the world still holds it.
        gc.collect()
        dist.destroy_process_group()
    except Exception:
        return
