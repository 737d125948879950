"""``ORCHESTRATE_TIMEOUT_S`` as torch.distributed's *default* process-group timeout, without
importing torch.

A ``command:`` program that calls ``init_process_group()`` without ``timeout=`` gets torch's
defaults: 30 minutes for gloo, 10 for nccl. A job's ``distributed.timeout_s`` should bound it
instead, without any change to the program. So the rank sidecar's start-up (which runs in every
Python rank as ``sitecustomize``) calls :func:`bound_from`: it patches the defaults right after
``torch.distributed.distributed_c10d`` is imported (a meta-path finder wraps that one module's
loader; every other import costs one string compare), or at once when it already is.

What it bounds: every ``init_process_group``, ``new_group``/``new_subgroups`` and
``monitored_barrier`` called without ``timeout=``, including the env:// store rendezvous inside
``init_process_group``, so a peer that never arrives fails the others after the bound. What it
does not bound: an explicit ``timeout=`` wins; code outside collectives (a sleep, a stuck data
loader, I/O) has no timeout at all; a ``TCPStore`` the program builds itself keeps its own;
nccl enforces the timeout only through its watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on
by default).

Standard library only, Python 3.8+, and nothing from orchestrate: the sidecar folder carries a
copy of this module (:mod:`orchestrate.diagnosis.rankpackage`).
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

ENV_TIMEOUT = "ORCHESTRATE_TIMEOUT_S"
_C10D = "torch.distributed.distributed_c10d"


def bound_from(environ: Any) -> float | None:
    """Bound the default timeout to ``ORCHESTRATE_TIMEOUT_S`` when it holds a positive, finite
    number of seconds; returns the bound (None: unset or unusable, nothing changed)."""
    raw = str(environ.get(ENV_TIMEOUT, "")).strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        return None
    if not 0 < seconds < float("inf"):
        return None
    bound_default_timeout(seconds)
    return seconds


def bound_default_timeout(seconds: float) -> None:
    """Make torch.distributed's default process-group timeout ``seconds`` (see the module
    docstring): now when ``distributed_c10d`` is loaded, else right after it is."""
    module: Any = sys.modules.get(_C10D)
    if module is not None:
        _patch_timeouts(module, seconds)
        return
    for finder in sys.meta_path:
        if isinstance(finder, _PatchAfterImport):
            finder.seconds = seconds
            return
    sys.meta_path.insert(0, _PatchAfterImport(seconds))


def _patch_timeouts(module: Any, seconds: float) -> None:
    from datetime import timedelta

    value = timedelta(seconds=seconds)
    # _get_default_timeout() reads these module globals at call time.
    module.default_pg_timeout = value
    if isinstance(getattr(module, "default_pg_nccl_timeout", None), timedelta):
        module.default_pg_nccl_timeout = value
    constants: Any = sys.modules.get("torch.distributed.constants")
    if constants is not None:
        constants.default_pg_timeout = value
        if isinstance(getattr(constants, "default_pg_nccl_timeout", None), timedelta):
            constants.default_pg_nccl_timeout = value


class _PatchAfterImport:
    """A meta-path finder that wraps the loader of distributed_c10d and patches it once
    executed (before ``torch.distributed`` copies its names); costs one string compare per
    import otherwise."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.busy = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _C10D or self.busy:
            return None
        self.busy = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _PatchingLoader(spec.loader, self)  # type: ignore[assignment]
        return spec


class _PatchingLoader:
    def __init__(self, inner: Any, finder: _PatchAfterImport) -> None:
        self.inner = inner
        self.finder = finder

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        try:
            _patch_timeouts(module, self.finder.seconds)
        finally:
            if self.finder in sys.meta_path:
                sys.meta_path.remove(self.finder)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks
        return getattr(self.inner, name)
