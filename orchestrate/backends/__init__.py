"""Backends run a prepared job: ``local`` (this machine), ``slurm`` (sbatch) and ``ssh``.

Each one implements :class:`~orchestrate.backends.base.Backend`; the CLI looks them up by the
job's ``backend`` name and never imports one it does not use (Fabric and submitit are optional).
"""

from __future__ import annotations

import importlib

from orchestrate.backends.base import Backend

_MODULES = {
    "local": "orchestrate.backends.local",
    "slurm": "orchestrate.backends.slurm",
    "ssh": "orchestrate.backends.ssh",
}


def get_backend(name: str) -> Backend:
    """The backend called ``name``."""
    module = importlib.import_module(_MODULES[name])
    backend: Backend = module.BACKEND
    return backend
