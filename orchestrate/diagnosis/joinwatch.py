"""The join watch: whether a Python process of a job forms a process group, and as what.

A rank's own sidecar (:mod:`orchestrate.diagnosis.sidecar`) starts in the process a launch
script starts for that rank. Every other Python process of the job gets this instead (from the
sidecar folder's ``sitecustomize``: :mod:`orchestrate.diagnosis.activation`): the process a
``per_node`` node starts and the workers it spawns (``torch.multiprocessing.spawn``), torchrun's
agent, the workers that torchrun or mp.spawn start inside a ``ranks`` job, DataLoader workers.
It is a daemon thread that looks, about once a second, whether its process has initialised
``torch.distributed`` (never importing it), and then, once:

- under a launcher that starts workers (``ORCHESTRATE_LAUNCHER``: ``per_node``, ``torchrun``)
  and with no other sidecar of the job running above it, the process becomes the rank it joined
  as: its sidecar starts for that rank (heartbeats, stacks on request), and records the join;
- otherwise it records the join alone (:func:`record`): the rank and world size it joined with,
  which the launcher's world check (:mod:`orchestrate.diagnosis.world`) compares with the plan,
  so that a program that builds its own world (mp.spawn or torchrun inside a ``ranks`` job) is
  named at once instead of training separate models to a COMPLETED job.

A rank's sidecar records its own join the same way. A forked child starts its own watch. It
costs a sleeping thread (a dictionary look-up a second); the records, the sidecar and their
imports load only in a process that joins. Standard library only, Python 3.8+.
"""

from __future__ import annotations

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


def record(run_dir: str, rank: int, world_size: int, heartbeats: bool) -> None:
    """Write this process's join (``diag/joined/<attempt>/<host>-<pid>.json``); never raises."""
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
        path = DiagFiles(Path(run_dir)).joined_by(attempt, host, pid)
        os.makedirs(str(path.parent), exist_ok=True)
        temporary = f"{path}.{pid}.tmp"
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
            if live_sidecar() is not None:
                return  # a sidecar of this process records the join itself
            joined = dist_world()
            if joined is None:
                continue
            if upgrade:
                start(run_dir, joined[0])  # its first heartbeat records the join
            else:
                record(run_dir, joined[0], joined[1], heartbeats=False)
            return
    except BaseException:  # never let an error of ours reach the program
        return
