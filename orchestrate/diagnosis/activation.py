"""What the rank sidecar's ``sitecustomize.py`` does when Python starts: bound torch's default
timeout, start the sidecar in a rank process (not in its children), then run the
``sitecustomize`` it hides.

The launch scripts put ``RUN_DIR/sidecar`` first on ``PYTHONPATH``; Python runs its
``sitecustomize.py`` in *every* process started under a rank, so it calls
:func:`run_as_sitecustomize` of the copy of this module in ``_orchestrate_rank/`` beside it
(:mod:`orchestrate.diagnosis.rankpackage`):

- ``ORCHESTRATE_CPU_BIND`` binds the process to its GPU's NUMA node
  (:mod:`orchestrate.hostside.cpubind`), whether or not the sidecar runs;
- ``ORCHESTRATE_TIMEOUT_S`` bounds torch.distributed's default timeout
  (:mod:`orchestrate.hostside.timeouts`), whether or not the sidecar runs;
- when ``ORCHESTRATE_RUN_DIR`` and ``RANK`` are set and ``ORCHESTRATE_SIDECAR`` is not ``0``,
  the sidecar (:mod:`orchestrate.diagnosis.sidecar`) starts once per rank process and records
  its pid in ``ORCHESTRATE_SIDECAR_PID``. Any Python started from the rank
  (multiprocessing/DataLoader workers with spawn, the resource tracker, helper scripts) inherits
  that variable, sees a live process that is not itself, and gets only the join watch
  (:mod:`orchestrate.diagnosis.joinwatch`), which records a process group such a process forms.
  A stale value (that process is gone) or our own pid after ``exec`` starts the sidecar anew;
- a process without RANK (a ``per_node`` node's process and the workers it spawns, torchrun's
  agent) gets the join watch too: a worker that joins its process group under a launcher that
  starts workers becomes the rank it joined as (its sidecar starts then);
- in every one of them, ``init_process_group`` is wrapped when the program imports
  ``torch.distributed``, so each process group is recorded as it forms
  (:func:`orchestrate.diagnosis.joinwatch.hook`);
- afterwards any other ``sitecustomize`` later on ``sys.path`` (Debian ships one) is loaded
  too, so we never shadow it.

Those children pay for this module, the timeout bound and the join watch (``threading`` and
a thread that sleeps): the sidecar, its records and their imports load only in the process that
starts it.
Standard library only, Python 3.8+.
"""

from __future__ import annotations

import os
import sys

from orchestrate.hostside.cpubind import bind_from
from orchestrate.hostside.timeouts import bound_from

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

ENV_RUN_DIR = "ORCHESTRATE_RUN_DIR"
ENV_SWITCH = "ORCHESTRATE_SIDECAR"


def enabled(environ: Any) -> bool:
    """Whether the launcher wants the sidecar (``ORCHESTRATE_SIDECAR`` is not ``0``)."""
    return str(environ.get(ENV_SWITCH, "1")).strip() != "0"


def activate(environ: Any) -> Any:
    """Bound the default timeout, then start the sidecar in a rank process, or the join watch
    in any other process of the job (:mod:`orchestrate.diagnosis.joinwatch`); returns the
    sidecar started, or None."""
    bound_from(environ)
    run_dir = str(environ.get(ENV_RUN_DIR, "")).strip()
    if not run_dir or not enabled(environ):
        return None
    # Imported here: the timeout bound alone needs neither.
    from orchestrate.diagnosis.joinwatch import hook, owner_elsewhere, watch

    hook(run_dir, start_sidecar)  # every process: each join recorded as init_process_group returns
    rank = str(environ.get("RANK", "")).strip()
    if not rank.isdigit() or owner_elsewhere(environ):
        watch(run_dir, environ, start_sidecar)  # a rank's children, a launcher and its workers
        return None
    return start_sidecar(run_dir, int(rank))


def start_sidecar(run_dir: str, rank: int) -> Any:
    """Start this process's sidecar as ``rank`` (imported here: it and its records load only in
    a process that is a rank, or becomes one)."""
    from orchestrate.diagnosis.sidecar import start

    return start(run_dir, rank)


def run_as_sitecustomize(entry: str) -> None:
    """Everything the ``sitecustomize.py`` at ``entry`` does: :func:`activate` (an error of
    ours never stops the program: one line on stderr), then run the ``sitecustomize`` it
    hides."""
    try:
        bind_from(os.environ)  # first: a rank's threads start on its GPU's NUMA node
    except OSError as exc:
        sys.stderr.write(f"orchestrate: CPUs not bound: {exc}\n")
    try:
        activate(os.environ)
    except Exception as exc:
        sys.stderr.write(f"orchestrate sidecar: not started: {type(exc).__name__}: {exc}\n")
    _chain_load_next_sitecustomize(entry)


def _chain_load_next_sitecustomize(entry: str) -> None:
    """Run the ``sitecustomize`` that ours hides (later on sys.path), as site.py would."""
    import importlib.machinery
    import importlib.util

    mine = os.path.realpath(entry)
    here = os.path.dirname(mine)
    entries = []
    seen_here = False
    for path in sys.path:
        real = os.path.realpath(path or os.getcwd())
        if real == here:
            seen_here = True
            continue
        if seen_here:
            entries.append(path)
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", entries)
    if spec is None or spec.loader is None or not spec.origin:
        return
    if os.path.realpath(spec.origin) == mine:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.stderr.write(f"Error in sitecustomize {spec.origin}; {type(exc).__name__}: {exc}\n")
